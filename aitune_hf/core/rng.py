"""Random generators left as found: what no replay for tuning may change (docs/guarantees.md, global state)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def rng_preserved() -> Iterator[None]:
    """Put torch's default generators back as they were when the block is left (raised out of or not): the CPU one
    and, once CUDA is initialised, every CUDA device's. A replay for tuning (eager references, builds, checks, timed
    runs) draws from them as often as the forward does; the user's next draw must not see that.

    Generators the user passes in a call are snapshotted with the call (`Sample`), so replays draw from copies. A
    thread drawing from the default generator while another thread tunes is rewound with it: its draws may repeat.
    """
    cpu = torch.random.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        torch.random.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
