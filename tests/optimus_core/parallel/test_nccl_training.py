"""On 2 GPUs (NCCL): data + expert parallel training follows the 1-GPU run of the same model,
data and global batch, with the loop reference and with the Triton kernels (float32)."""

import pytest
import torch

from optimus_core.config import RunConfig
from optimus_core.train.loop import Trainer
from sinks import ListSink

from ranks import train_on_ranks
from test_distributed_training import STEPS, _cfg, _rows

pytestmark = [pytest.mark.gpu, pytest.mark.multi_gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]


def _gpu_cfg(backend: str, **kw) -> RunConfig:
    cfg = _cfg(**kw)  # float32 on the GPU too, so that the runs can agree to 1e-4; no compile (not the point)
    return cfg.replace(execution=cfg.execution.replace(experts=backend, dtype="float32", compile=False),
                       train=cfg.train.replace(device="cuda"))


@pytest.mark.parametrize("backend", ["loop", "triton"])
@pytest.mark.parametrize("ep, optimizer", [(2, "ep_aware"), (1, "ep_aware"), (2, "dp_sharded")])
def test_two_gpus_follow_one_gpu(tokens_dir, tmp_path, backend, ep, optimizer):
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 products, so the runs can agree
    sink = ListSink()
    Trainer(_gpu_cfg(backend), tokens_dir, tmp_path / "one", writer=sink, progress=False).fit()
    ref = _rows(sink)
    got = train_on_ranks(2, _gpu_cfg(backend, ep=ep, optimizer=optimizer), tokens_dir, tmp_path / "two",
                         tmp_path / "rows.json", _rows, start_method="spawn")
    assert got["steps"] == list(range(1, STEPS + 1))
    assert max(abs(a - b) for a, b in zip(got["loss"], ref["loss"])) < 1e-4
    torch.testing.assert_close(torch.tensor(got["load"]), torch.tensor(ref["load"]))
