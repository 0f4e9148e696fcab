"""One rank of a two-process check of the forking mask and the adaptive controller (gloo on CPU): each rank
has its own number of valid tokens; TRL's own get_high_entropy_mask (a real Accelerator, which pads and
gathers across the processes) against entropylens' top_entropy_mask with gather_valid, and the controller's
window reduced over both ranks. Saves OUT/rank{R}.pt.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/helpers/forking_two_ranks.py OUT
"""

import sys
from types import SimpleNamespace

import torch


def main(out: str) -> None:
    from accelerate import Accelerator
    from trl import GRPOTrainer

    from entropylens.rl.forking import AdaptiveEntropyCoef, all_reduce_sum, gather_valid, top_entropy_mask

    acc = Accelerator(cpu=True)
    rank = acc.process_index
    g = torch.Generator().manual_seed(11 + rank)
    h = torch.rand(4, 7, generator=g) * (1.0 + 2.0 * rank)  # rank 1's entropies higher: global != local
    m = torch.rand(4, 7, generator=g) > (0.2 + 0.4 * rank)  # different valid counts per rank
    q = 0.2
    theirs = GRPOTrainer.get_high_entropy_mask(SimpleNamespace(accelerator=acc), h, m, 1 - q)
    ours = top_entropy_mask(h, m, q, all_gather=gather_valid)
    local = top_entropy_mask(h, m, q)
    ctrl = AdaptiveEntropyCoef(target=1.5, coef=0.1, delta=0.01)
    ctrl.observe(h, m.float())
    world = ctrl.step(all_reduce_sum())
    # the expected token-weighted mean over both ranks, from the gathered values themselves
    all_h = gather_valid(h[m].float())
    expected_world = float(all_h.mean())
    coef_expected = 0.11 if expected_world <= 1.5 else 0.09
    torch.save(
        {
            "ours": ours,
            "trl": theirs,
            "local": local,
            "ctrl": [world, ctrl.coef],
            "ctrl_expected": [expected_world, coef_expected],
        },
        f"{out}/rank{rank}.pt",
    )


if __name__ == "__main__":
    main(sys.argv[1])
