"""The store's facade (:class:`TieredStore`): the object users create, attach and close, on top
of every other part, which it composes (docs/architecture.md)."""

from infinity.planning import planner
from infinity.store.facade import TieredStore

# The planner replays candidates through a store of this kind (planner.simulate), which it
# cannot import: it is a layer below.
planner.replay_with(TieredStore)

__all__ = ["TieredStore"]
