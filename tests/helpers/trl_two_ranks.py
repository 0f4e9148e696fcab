"""One rank of a two-process TRL run (launched by torch.distributed.run; gloo on CPU through accelerate).

python -m torch.distributed.run --nproc_per_node 2 tests/helpers/trl_two_ranks.py OUT
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import trl_tiny  # noqa: E402


def main(out: str) -> None:
    torch.set_num_threads(1)
    tr = trl_tiny.trainer(out, None, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=2)
    tr.train()


if __name__ == "__main__":
    main(sys.argv[1])
