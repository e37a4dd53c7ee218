"""Load time of a megatron distributed checkpoint (dist_checkpointing, torch_dist) into the paged GPT.

Model (default): 16 layers, hidden 2048, ffn 8192, 16 query heads over 4 KV groups, 2 MTP layers,
vocab 32000, bf16, megatron-core's local layers (944M parameters, 1.9 GB), as bench/bench_forward.py;
``--quick``: a 2-layer toy. The model is saved with ``dist_checkpointing`` (megatron's default
torch_dist writer on CUDA, the synchronous one on the CPU) unless ``--checkpoint-dir`` already
holds a checkpoint (e.g. one saved at another TP size). Then, ``--repeats`` times, alternating:

- ``ours``: ``mtp_ctrl.models.load_distributed_checkpoint`` (checks keys and shapes against the
  checkpoint's metadata, reads into fresh tensors, copies them in);
- ``megatron``: the plain path, ``model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), dir))``
  (reads into the parameters in place; no checks of ours);

each into a fresh model on the device, timed from the call to the last byte on the device
(CUDA synchronised). Reported: median seconds, spread, and GB/s of checkpoint bytes. The files
were just written or read, so they come from the page cache (a warm load; a cold load is bound
by the disk). Both paths must give the same weights (checked).

    python bench/bench_load.py                                          # H100: save + load at TP 1
    torchrun --nproc-per-node 2 bench/bench_load.py --tp 2 --checkpoint-dir /tmp/ckpt_tp2   # save at TP 2
    python bench/bench_load.py --checkpoint-dir /tmp/ckpt_tp2           # load that at TP 1 (resharding)
    python bench/bench_load.py --quick --device cpu                     # smoke run on a CPU
"""

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 2-layer toy model")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (= processes under torchrun)")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="load this checkpoint; if it is missing, save one there first (default: a temporary dir)")
    parser.add_argument("--repeats", type=int, default=3, help="timed loads per path")
    parser.add_argument("--verbose", action="store_true", help="show megatron-core's import-time warnings too")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.tp < 1:
        parser.error("--repeats and --tp must be >= 1")
    return args


if __name__ == "__main__":
    ARGS = parse_args()  # --help answers before torch loads
    import mtp_ctrl

    mtp_ctrl.quiet_known_warnings(ARGS.verbose)  # before megatron-core is imported
    if not ARGS.verbose:  # torch.distributed.checkpoint's deprecation notices on megatron's plain load path
        import warnings

        warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed\.checkpoint")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core import dist_checkpointing, parallel_state  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from mtp_ctrl.models import build_gpt_model, load_distributed_checkpoint, save_distributed_checkpoint  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))  # noqa: E402
from demo_model import init_distributed  # noqa: E402  one process, or every torchrun rank

FULL_MODEL = dict(num_layers=16, hidden_size=2048, ffn_hidden_size=8192, num_attention_heads=16,
                  num_query_groups=4, mtp_num_layers=2, vocab_size=32000)
QUICK_MODEL = dict(num_layers=2, hidden_size=256, ffn_hidden_size=1024, num_attention_heads=8,
                   num_query_groups=2, mtp_num_layers=2, vocab_size=512)
MAX_SEQUENCE_LENGTH = 4096


def build_model(shape: dict, device: torch.device, tp: int, seed: int):
    """The paged GPT in bf16 on ``device``, weights drawn from ``seed``."""
    fields = {name: value for name, value in shape.items() if name != "vocab_size"}
    config = TransformerConfig(**fields, hidden_dropout=0.0, attention_dropout=0.0, bf16=True,
                               params_dtype=torch.bfloat16, tensor_model_parallel_size=tp,
                               use_cpu_initialization=device.type != "cuda")
    if device.type == "cuda":  # megatron draws GPU weights from its own RNG tracker
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
    return build_gpt_model(config, shape["vocab_size"], MAX_SEQUENCE_LENGTH, use_transformer_engine=False) \
        .to(device).eval()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()


def checkpoint_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(path) for name in names)


def megatron_plain_load(model, path: str) -> None:
    model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), path), strict=False)


def main() -> None:
    args = ARGS
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --device cpu (and --quick)")
    init_distributed(args.tp, device)
    rank0 = dist.get_rank() == 0
    shape = QUICK_MODEL if args.quick else FULL_MODEL
    temporary = None
    path = args.checkpoint_dir
    if path is None:
        temporary = tempfile.mkdtemp(prefix="bench_load_") if rank0 else None
        shared = [temporary]
        dist.broadcast_object_list(shared, src=0)
        path = shared[0]
    saved_seconds = None
    if not dist_checkpointing.check_is_distributed_checkpoint(path):
        model = build_model(shape, device, args.tp, seed=0)
        synchronize(device)
        started = time.perf_counter()
        save_distributed_checkpoint(model, path, content_metadata={"model_args": shape, "tp": args.tp})
        synchronize(device)
        saved_seconds = time.perf_counter() - started
        del model
    size_gb = checkpoint_bytes(path) / 1e9
    loaders = {"ours": load_distributed_checkpoint, "megatron": megatron_plain_load}
    seconds = {name: [] for name in loaders}
    weights = {}
    for repeat in range(args.repeats):
        for name, load in loaders.items():
            model = build_model(shape, device, args.tp, seed=1 + repeat)
            synchronize(device)
            started = time.perf_counter()
            load(model, path)
            synchronize(device)
            seconds[name].append(time.perf_counter() - started)
            if repeat == 0:
                weights[name] = {key: value.detach().clone() for key, value in model.named_parameters()}
            del model
    same = all(torch.equal(weights["ours"][key], weights["megatron"][key]) for key in weights["ours"])
    if rank0:
        saved_tp = (dist_checkpointing.load_content_metadata(path) or {}).get("tp", "?")
        parameters = sum(value.numel() for value in weights["ours"].values()) * args.tp  # approximate under TP
        print(f"\ncheckpoint {path}: {size_gb:.3f} GB, saved at TP {saved_tp}"
              f"{f' in {saved_seconds:.2f} s' if saved_seconds is not None else ''}; loaded at TP {args.tp} on "
              f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}; "
              f"~{parameters / 1e6:.0f}M parameters")
        print(f"{'path':10}{'median s':>10}{'min..max s':>16}{'GB/s':>8}")
        for name, values in seconds.items():
            median = statistics.median(values)
            print(f"{name:10}{median:10.3f}{f'{min(values):.3f}..{max(values):.3f}':>16}{size_gb / median:8.2f}")
        print(f"same weights from both paths: {'yes' if same else 'NO'}")
    dist.barrier()
    if temporary is not None and rank0:
        shutil.rmtree(temporary, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
