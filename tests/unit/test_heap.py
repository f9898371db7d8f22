"""moe_rl.trainer.heap: the run's objects are frozen out of the collector, new cycles
are still collected, and the freeze ends with the run."""

import gc
import weakref

from moe_rl.trainer.heap import frozen_heap


class Node:
    pass


def test_objects_alive_at_the_start_are_frozen_and_released_after():
    kept = [Node() for _ in range(10)]
    with frozen_heap():
        assert gc.get_freeze_count() >= len(kept)
    assert gc.get_freeze_count() == 0


def test_a_cycle_made_inside_is_still_collected():
    with frozen_heap():
        a, b = Node(), Node()
        a.other, b.other = b, a
        probe = weakref.ref(a)
        del a, b
        gc.collect()
        assert probe() is None
