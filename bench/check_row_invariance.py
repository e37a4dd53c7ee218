"""Do the demo model's matrix multiplies give a row the same bits whatever the step's row count?

    python bench/check_row_invariance.py                 # GPU: the demo model's weights, fp32 and bf16
    python bench/check_row_invariance.py --device cpu    # this machine's BLAS

Exact-match acceptance makes speculative output independent of the drafts; it equals plain
decoding's token for token only where each row's logits are the same bits in a plain step (G rows),
a verify step (G (1 + V) rows) and a step with prompt chunks (hundreds to thousands of rows). This
script takes every 2-D weight of the demo model (attention, MLP, MTP layers, output layer), feeds
``F.linear`` the same random rows stacked to each ``--rows`` count, and reports, per dtype and
weight shape, the row counts at which row 0 differs from the 1-row product, and by how much (the
largest absolute difference over the first 8 rows). Nothing differing: those GEMMs are
row-invariant on this device at those counts (bench/RESULTS.md, "Adaptive draft length",
sixteenth session, has the output that motivated it).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import mtp_ctrl  # noqa: E402

ROWS = (1, 2, 8, 32, 96, 128, 384, 448, 1024, 1408, 4096, 8192)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, help="default: cuda when there is one, else cpu")
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS), help="row counts to compare with 1 row")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                        choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--verbose", action="store_true", help="show megatron-core's import-time warnings too")
    return parser.parse_args()


def weight_shapes(model) -> dict:
    """Each distinct 2-D weight shape of ``model`` -> the names of the parameters that have it (the
    word embeddings too: the demo's output layer multiplies by them)."""
    shapes = {}
    for name, parameter in model.named_parameters():
        if parameter.dim() == 2 and "position_embeddings" not in name:
            shapes.setdefault(tuple(parameter.shape), []).append(name)
    return shapes


def differing_rows(weight: torch.Tensor, rows, generator) -> list:
    """``[(row count, max abs difference)]`` where rows 0..7 of ``F.linear`` over that many rows
    differ from the same rows computed alone (the most rows first, so every count has its rows)."""
    most = max(rows)
    inputs = torch.randn(most, weight.shape[1], generator=generator, device="cpu").to(weight.device, weight.dtype)
    alone = torch.cat([F.linear(inputs[index: index + 1], weight) for index in range(min(8, most))])
    found = []
    for count in rows:
        stacked = F.linear(inputs[:count], weight)[: min(8, count)]
        if not torch.equal(stacked, alone[: stacked.shape[0]]):
            found.append((count, float((stacked.float() - alone[: stacked.shape[0]].float()).abs().max())))
    return found


def main(args) -> int:
    mtp_ctrl.quiet_known_warnings(args.verbose)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    mtp_ctrl.init_single_process(device)
    model = mtp_ctrl.load_demo_model(device=device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"{name}; torch {torch.__version__}; TF32 matmul {torch.backends.cuda.matmul.allow_tf32}; "
          f"row counts {args.rows}")
    generator, shapes, differing = torch.Generator().manual_seed(0), weight_shapes(model), 0
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        for shape, names in sorted(shapes.items()):
            weight = dict(model.named_parameters())[names[0]].detach().to(dtype)
            found = differing_rows(weight, args.rows, generator)
            differing += bool(found)
            listed = ", ".join(f"{count} ({diff:.1e})" for count, diff in found) or "none"
            print(f"{dtype_name:9} weight {str(list(shape)):14} ({len(names)} like {names[0]}): row counts that "
                  f"change rows 0-7: {listed}")
    print(f"{differing} of {len(shapes) * len(args.dtypes)} (dtype, weight shape) pairs are not row-invariant here")
    return differing


if __name__ == "__main__":
    main(parse_args())
