"""StepPipeline (vt/engine/pipeline.py): which step the loop collects after a launch, and
when a stop seen in a collected step takes effect, at depth 1 and depth 2. The two must
apply a stop after the same launch (the one after the step that sampled it), or the two
depths would plan different steps."""
import pytest

from vt.engine.pipeline import CollectAtOnce, CollectNextStep, step_pipeline


def _run(pipeline, steps):
    """Launch steps 0..steps-1 as the loop does; step 1's collect reports a stop of "r".
    Returns, per launch, (the step collected, what had left before that launch's collect)."""
    left, seen = [], []
    pipeline.leave = left.append
    for n in range(steps):
        ready = pipeline.launched(n)
        before = list(left)
        if ready is not None:
            pipeline.collected(["r"] if ready == 1 else [])
        seen.append((ready, before, list(left)))
    return seen


def test_depth_2_collects_the_step_before_and_applies_its_stop_at_once():
    seen = _run(CollectNextStep(None), 4)
    assert [s[0] for s in seen] == [None, 0, 1, 2]
    # step 1 is collected after step 2's launch: "r" leaves before step 3 is planned
    assert seen[2] == (1, [], ["r"])


def test_depth_1_collects_at_once_and_applies_its_stop_after_the_next_launch():
    seen = _run(CollectAtOnce(None), 4)
    assert [s[0] for s in seen] == [0, 1, 2, 3]
    assert seen[1] == (1, [], [])            # seen in step 1's tokens, not applied yet
    assert seen[2] == (2, ["r"], ["r"])      # applied after step 2's launch, as at depth 2


@pytest.mark.parametrize("depth", [1, 2])
def test_a_dropped_pipeline_holds_nothing(depth):
    pipeline = step_pipeline(depth, lambda r: None)
    pipeline.launched("h")
    pipeline.collected(["r"])
    pipeline.drop()
    assert pipeline.empty() and pipeline.in_flight is None


def test_a_depth_other_than_1_or_2_is_refused_naming_it():
    with pytest.raises(ValueError, match="got 3"):
        step_pipeline(3, lambda r: None)
