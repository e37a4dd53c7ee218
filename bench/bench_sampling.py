"""Token sampling: the Triton kernel vs the old sort-based torch path, with the HBM floor.

Rows of random logits (randn * 4, float32), temperature 0.7, top-p 0.9, top-k off, one seed and
position per row. Every figure is a median: each path is captured in a CUDA graph (as the
controller's step is) and timed with ``triton.testing.do_bench_cudagraph``:
  torch old  - the sort-based sampler the controller used before the kernel (copied below);
  twin       - the kernel's torch twin (sort + searchsorted), the CPU path;
  kernel     - ``mtp_ctrl.triton_ops.sample_tokens`` (one program per row, no sort);
  floor      - logits bytes / device-copy bandwidth (read + write bytes per second) of the same run;
  flashinfer - softmax(logits / T) + ``flashinfer.sampling.top_p_sampling_from_probs``, eager
               ``do_bench``, when flashinfer is installed.

    python bench/bench_sampling.py            # vocab 32k and 128k, batch 1, 8, 32, 256
    python bench/bench_sampling.py --quick    # vocab 128k, batch 1 and 32
"""

import argparse

import torch
import triton
import triton.testing

from mtp_ctrl.triton_ops import reference, sample_tokens
from mtp_ctrl.triton_ops.reference.sampling import GREEDY_TEMPERATURE, gumbel_noise

TEMPERATURE, TOP_P = 0.7, 0.9


def old_sample_tokens(logits, temperature, top_k, top_p, seeds, positions):
    """The sort-based sampler of controllers/sampling.py before the kernel."""
    logits = logits.float()
    greedy_tokens = logits.argmax(dim=-1)
    is_greedy = temperature < GREEDY_TEMPERATURE
    scaled = logits / torch.where(is_greedy, torch.ones_like(temperature), temperature).unsqueeze(1)
    vocab_size = scaled.shape[-1]
    sorted_logits, sorted_ids = scaled.sort(dim=-1, descending=True)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab_size), torch.full_like(top_k, vocab_size))
    sorted_logits = sorted_logits.masked_fill(sorted_logits < sorted_logits.gather(1, (k - 1).unsqueeze(1)),
                                              float("-inf"))
    sorted_probs = sorted_logits.softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    outside = (mass_before >= top_p.unsqueeze(1)) & (top_p.unsqueeze(1) < 1.0)
    sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
    scaled = torch.full_like(scaled, float("-inf")).scatter(1, sorted_ids, sorted_logits)
    sampled = (scaled + gumbel_noise(seeds, positions, vocab_size)).argmax(dim=-1)
    return torch.where(is_greedy, greedy_tokens, sampled)


def graph_us(fn):
    """Median us of one call of ``fn`` replayed from a CUDA graph."""
    fn()  # compile / warm up outside the graph
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3


def copy_bandwidth():
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    src = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")  # 256 MiB
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * src.numel() / (ms * 1e-3)


def flashinfer_us(logits, temperature):
    try:
        import flashinfer.sampling as fis
    except ImportError:
        return None

    def run():
        probs = torch.softmax(logits / temperature[:, None], dim=-1)
        return fis.top_p_sampling_from_probs(probs, TOP_P)

    run()
    return triton.testing.do_bench(run, return_mode="median") * 1e3


def bench_point(vocab_size, batch, bandwidth):
    logits = torch.randn(batch, vocab_size, device="cuda") * 4  # [B, V] float32
    params = [torch.full((batch,), TEMPERATURE, device="cuda"),  # temperature [B]
              torch.zeros(batch, dtype=torch.int64, device="cuda"),  # top_k [B]: off
              torch.full((batch,), TOP_P, device="cuda"),  # top_p [B]
              torch.arange(batch, device="cuda") + 12345,  # seeds [B]
              torch.arange(batch, device="cuda") + 77]  # positions [B]
    out = torch.empty(batch, dtype=torch.int64, device="cuda")
    kernel_tokens = sample_tokens(logits, *params)
    agree = torch.equal(kernel_tokens, reference.sample_tokens(logits, *params))
    times = dict(
        old=graph_us(lambda: old_sample_tokens(logits, *params)),
        twin=graph_us(lambda: reference.sample_tokens(logits, *params)),
        kernel=graph_us(lambda: sample_tokens(logits, *params, out=out)),
        floor=logits.numel() * logits.element_size() / bandwidth * 1e6,
        flashinfer=flashinfer_us(logits, params[0]),
    )
    return times, agree


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="vocab 128k, batch 1 and 32 only")
    parser.add_argument("--verbose", action="store_true", help="show every warning (this script imports no megatron)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_sampling: needs a CUDA GPU; nothing to measure here.")
        return
    vocab_sizes = [128256] if args.quick else [32000, 128256]
    batches = [1, 32] if args.quick else [1, 8, 32, 256]
    bandwidth = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}, triton {triton.__version__}, torch {torch.__version__}; "
          f"copy bandwidth {bandwidth / 1e9:.0f} GB/s (read + write); T = {TEMPERATURE}, top_p = {TOP_P}, fp32 logits")
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        print("flashinfer is not installed: its column is left empty")
    header = f"{'vocab':>7} {'batch':>5} {'torch old us':>12} {'twin us':>9} {'kernel us':>9} {'old/kernel':>10} " \
             f"{'floor us':>8} {'flashinfer us':>13} {'kernel==twin':>12}"
    print(header)
    for vocab_size in vocab_sizes:
        for batch in batches:
            t, agree = bench_point(vocab_size, batch, bandwidth)
            fi = "-" if t["flashinfer"] is None else f"{t['flashinfer']:.1f}"
            print(f"{vocab_size:>7} {batch:>5} {t['old']:>12.1f} {t['twin']:>9.1f} {t['kernel']:>9.1f} "
                  f"{t['old'] / t['kernel']:>9.1f}x {t['floor']:>8.1f} {fi:>13} {str(agree):>12}")


if __name__ == "__main__":
    main()
