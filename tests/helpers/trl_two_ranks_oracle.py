"""One rank of a two-process TRL run of the oracle (launched by torch.distributed.run, gloo on CPU): GA 2,
num_iterations 2, beta 0.04, top_entropy_quantile 0.2, SGD, TRL's dapo (LOSS "trl") or entropylens'
loss="dapo"; rank 0 saves the final weights to OUT/weights.pt.

    python -m torch.distributed.run --nproc_per_node 2 tests/helpers/trl_two_ranks_oracle.py OUT MODEL LOSS
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import trl_tiny  # noqa: E402


def main(out: str, model: str, loss: str) -> None:
    torch.set_num_threads(1)
    tr = trl_tiny.trainer(
        out,
        "r",
        model=model,
        el=dict(loss=loss) if loss != "trl" else None,
        loss_type="dapo",
        gradient_accumulation_steps=2,
        num_iterations=2,
        beta=0.04,
        top_entropy_quantile=0.2,
        max_steps=2,
        optim="sgd",
        learning_rate=0.5,
        max_completion_length=12,
        per_device_train_batch_size=4,
    )
    tr.train()
    if tr.accelerator.is_main_process:
        torch.save({k: v.detach().clone() for k, v in tr.model.state_dict().items()}, f"{out}/weights.pt")


if __name__ == "__main__":
    main(*sys.argv[1:4])
