"""Gated DeltaNet hybrids (Qwen3-Next shape): the decode/verify kernel's state traffic, the prefill
kernel against flash-linear-attention, and end-to-end decode at S = 0 vs S = 2.

    python bench/bench_gdn.py [--quick] [--skip-e2e] [--tune]

1. The decode/verify rows and their commit (one layer: 32 value heads, 16 key heads, K = V = 128,
   fp32 state), at batch 1, 32, 128 and S = 0, 2, 4: the old path (``gdn_decode_rows`` writes
   1 + S states, the commit copies one) against the replay path (``gdn_verify_rows`` reads the
   state once and stores the rows' inputs; ``gdn_replay_accepted`` steps the accepted rows from the
   committed state); state bytes / time against a same-run device copy's bandwidth, and each
   path's S = 2 step over its S = 0 step (the issue's target: <= 1.5x).
2. ``gdn_varlen_scan`` (ours, recurrent, one segment) vs fla-core's ``chunk_gated_delta_rule``
   (chunked, from the same initial state, final state out): tokens/s at chunk 64 .. 8192 (fla
   only when installed).
3. End to end: a Qwen3-Next-shaped hybrid scaled to one GPU (24 layers GDN : attention 3 : 1,
   hidden 2048, gated attention 16 heads over 2 KV groups of 256 with q/k norm and rotary on a
   quarter, 1 MTP layer as Qwen3-Next ships, rerun for depth 2 (``mtp_reuse_last_layer``), bf16,
   random weights: no draft is accepted, the worst case of speculation) with CUDA graphs: median wall ms of a decode step and tokens/s at S = 0 and 2,
   batch 1, 8, 32.

``--quick`` runs tiny shapes on the CPU (the torch twins; no fla, no end to end): a smoke test of
the script, not a measurement.
"""

import argparse
import statistics
import sys


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes on the CPU (a smoke test)")
    parser.add_argument("--skip-e2e", action="store_true", help="kernels only")
    parser.add_argument("--tune", action="store_true",
                        help="only sweep the verify and replay kernels' tiles and warps (batch 32, 128; S = 2)")
    parser.add_argument("--verbose", action="store_true", help="show megatron-core's import-time warnings too")
    return parser.parse_args(argv)


if __name__ == "__main__":
    ARGS = parse_args()  # --help answers before torch loads
    import mtp_ctrl

    mtp_ctrl.quiet_known_warnings(ARGS.verbose)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from mtp_ctrl.triton_ops import (  # noqa: E402
    gdn_decode_rows,
    gdn_replay_accepted,
    gdn_row_input_width,
    gdn_varlen_scan,
    gdn_verify_rows,
    mamba_state_selective_copy,
)


def _time_ms(fn, device, repeats):
    """Median ms of ``fn()`` (CUDA events on the GPU, wall clock on the CPU), after 2 warm-ups."""
    import time

    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            started = time.perf_counter()
            fn()
            times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def _rows(num_rows, key_heads, heads, key_dim, value_dim, device):
    q = F.normalize(torch.randn(num_rows, key_heads, key_dim, device=device), dim=-1) * key_dim ** -0.5
    k = F.normalize(torch.randn(num_rows, key_heads, key_dim, device=device), dim=-1)
    return dict(q=q, k=k, v=torch.randn(num_rows, heads, value_dim, device=device),
                g=-F.softplus(torch.randn(num_rows, heads, device=device)),
                beta=torch.sigmoid(torch.randn(num_rows, heads, device=device)))


def copy_bandwidth_gbs(device, num_bytes):
    source = torch.empty(num_bytes // 4, dtype=torch.float32, device=device)
    target = torch.empty_like(source)
    ms = _time_ms(lambda: target.copy_(source), device, 20)
    return 2 * num_bytes / ms / 1e6  # read + write


def decode_kernel_table(device, shape, batches, drafts):
    """Per step of one layer: the old path (``gdn_decode_rows`` writes 1 + S states, the commit copies
    one) against the replay path (``gdn_verify_rows`` reads the state and stores the rows' inputs,
    ``gdn_replay_accepted`` steps the accepted rows: every draft accepted, the most work). Returns
    {(path, batch, S): us}."""
    key_heads, heads, key_dim, value_dim = shape
    state_bytes = heads * key_dim * value_dim * 4
    copy_gbs = copy_bandwidth_gbs(device, max(batches) * state_bytes * (2 + max(drafts)))
    width = gdn_row_input_width(key_heads, key_dim, heads, value_dim)
    print(f"\n1. GDN decode/verify state traffic per step, one layer ({heads} value heads, {key_heads} key heads, "
          f"K = {key_dim}, V = {value_dim}, fp32 state {state_bytes / 2**20:.1f} MiB per request, row inputs "
          f"{width * 4 / 2**10:.1f} KiB); same-run device copy {copy_gbs:.0f} GB/s. old: gdn_decode_rows + copy "
          "commit (moves 1 + (1 + S) + 2 states); verify: gdn_verify_rows (reads 1 state; S = 0 also writes it); "
          "replay: gdn_replay_accepted, all drafts accepted (reads + writes 1 state); 'of copy' = state bytes / time "
          "/ copy GB/s")
    print(f"{'batch':>5} {'S':>2} | {'old us':>8} {'of copy':>7} {'vs S=0':>6} | {'verify us':>9} {'of copy':>7} "
          f"{'replay us':>9} {'of copy':>7} {'total us':>8} {'vs S=0':>6}")
    times = {}
    for batch in batches:
        for S in drafts:
            R = S + 1
            states = torch.zeros(1, batch + 1, heads, key_dim, value_dim, device=device)
            inter = torch.zeros(1, batch + 1, R, heads, key_dim, value_dim, device=device)
            row_inputs = torch.zeros(1, batch + 1, R, width, device=device)
            slots = torch.arange(batch, device=device)
            status = torch.zeros(batch, dtype=torch.int64, device=device)
            accepted = torch.full((batch,), S, dtype=torch.int64, device=device)
            rows = _rows(batch * R, key_heads, heads, key_dim, value_dim, device)

            def old_step():
                gdn_decode_rows(states, inter, 0, slots, **rows)
                mamba_state_selective_copy(inter, states, status, slots, accepted, 1)
            old_us = _time_ms(old_step, device, 20) * 1e3
            verify_us = _time_ms(lambda: gdn_verify_rows(states, row_inputs, 0, slots, **rows), device, 20) * 1e3
            replay_us = 0.0
            if S > 0:
                replay_us = _time_ms(lambda: gdn_replay_accepted(states, row_inputs, status, slots, accepted,
                                                                 key_heads), device, 20) * 1e3
            times.update({("old", batch, S): old_us, ("replay", batch, S): verify_us + replay_us})

            def share(states_moved, us):
                return f"{batch * state_bytes * states_moved / us / 1e3 / copy_gbs:7.0%}"
            replay_cells = f"{replay_us:9.1f} {share(2, replay_us)}" if S else f"{'-':>9} {'-':>7}"
            print(f"{batch:5d} {S:2d} | {old_us:8.1f} {share(1 + R + 2, old_us)} "
                  f"{old_us / times[('old', batch, 0)]:5.2f}x | {verify_us:9.1f} {share(1 if S else 2, verify_us)} "
                  f"{replay_cells} {verify_us + replay_us:8.1f} "
                  f"{(verify_us + replay_us) / times[('replay', batch, 0)]:5.2f}x")
    return times


def tune_table(device, shape, batches, S=2):
    """The verify and replay kernels at each (max BLOCK_V, num_warps) of their launch
    (``gdn_replay.VERIFY_TILE`` / ``REPLAY_TILE``): us and state bytes / time against a device copy."""
    from mtp_ctrl.triton_ops import gdn_replay

    key_heads, heads, key_dim, value_dim = shape
    state_bytes = heads * key_dim * value_dim * 4
    copy_gbs = copy_bandwidth_gbs(device, max(batches) * state_bytes * 2)
    width = gdn_row_input_width(key_heads, key_dim, heads, value_dim)
    print(f"\n--tune: S = {S}, copy {copy_gbs:.0f} GB/s; verify reads 1 state, replay reads + writes 1")
    print(f"{'batch':>5} {'BLOCK_V':>7} {'warps':>5} {'verify us':>9} {'of copy':>7} {'replay us':>9} {'of copy':>7}")
    defaults = dict(gdn_replay.VERIFY_TILE), dict(gdn_replay.REPLAY_TILE)
    for batch in batches:
        states = torch.zeros(1, batch + 1, heads, key_dim, value_dim, device=device)
        row_inputs = torch.zeros(1, batch + 1, S + 1, width, device=device)
        slots = torch.arange(batch, device=device)
        status = torch.zeros(batch, dtype=torch.int64, device=device)
        accepted = torch.full((batch,), S, dtype=torch.int64, device=device)
        rows = _rows(batch * (S + 1), key_heads, heads, key_dim, value_dim, device)
        for block_v in (16, 32, 64):
            for warps in (1, 2, 4, 8):
                tile = dict(max_block_v=block_v, num_warps=warps)
                gdn_replay.VERIFY_TILE.update(tile)
                gdn_replay.REPLAY_TILE.update(tile)
                verify = _time_ms(lambda: gdn_verify_rows(states, row_inputs, 0, slots, **rows), device, 20) * 1e3
                replay = _time_ms(lambda: gdn_replay_accepted(states, row_inputs, status, slots, accepted, key_heads),
                                  device, 20) * 1e3
                print(f"{batch:5d} {block_v:7d} {warps:5d} {verify:9.1f} "
                      f"{batch * state_bytes / verify / 1e3 / copy_gbs:7.0%} {replay:9.1f} "
                      f"{2 * batch * state_bytes / replay / 1e3 / copy_gbs:7.0%}")
    gdn_replay.VERIFY_TILE.update(defaults[0])
    gdn_replay.REPLAY_TILE.update(defaults[1])


def prefill_table(device, shape, chunks):
    key_heads, heads, key_dim, value_dim = shape
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        chunk_gated_delta_rule = None
    print(f"\n2. prefill of one request, one layer: tokens/s, ours (gdn_varlen_scan) vs fla-core chunk_gated_delta_rule"
          + ("" if chunk_gated_delta_rule else " (fla not installed)"))
    print(f"{'chunk':>6} {'ours ms':>9} {'ours tok/s':>11} {'fla ms':>8} {'fla tok/s':>10} {'max |diff|':>10}")
    for chunk in chunks:
        rows = _rows(chunk, key_heads, heads, key_dim, value_dim, device)
        initial = torch.randn(1, heads, key_dim, value_dim, device=device) * 0.1
        start, count = torch.zeros(1, dtype=torch.int64, device=device), torch.full((1,), chunk, device=device)
        ours_ms = _time_ms(lambda: gdn_varlen_scan(initial, **rows, row_start=start, row_count=count), device, 5)
        line = f"{chunk:6d} {ours_ms:9.3f} {chunk / ours_ms * 1e3:11.0f}"
        if chunk_gated_delta_rule is not None:
            ratio = heads // key_heads
            q, k = (rows[name].repeat_interleave(ratio, dim=1)[None] for name in ("q", "k"))

            def fla():
                return chunk_gated_delta_rule(q, k, rows["v"][None], rows["g"][None], rows["beta"][None], scale=1.0,
                                              initial_state=initial, output_final_state=True)
            fla_ms = _time_ms(fla, device, 5)
            ours_o, _ = gdn_varlen_scan(initial, **rows, row_start=start, row_count=count)
            diff = (fla()[0][0].float() - ours_o).abs().max().item()
            line += f" {fla_ms:8.3f} {chunk / fla_ms * 1e3:10.0f} {diff:10.2e}"
        print(line)


def end_to_end_table(batches, steps):
    import os
    import socket

    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_config import TransformerConfig

    from mtp_ctrl.controllers import InferenceConfig, TextGenerationController
    from mtp_ctrl.models import build_gpt_model
    from steady_decode import timed_decode_steps

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(sock.getsockname()[1]))
    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    vocab = 32768
    config = TransformerConfig(
        num_layers=24, hidden_size=2048, ffn_hidden_size=5632, num_attention_heads=16, num_query_groups=2,
        kv_channels=256, mtp_num_layers=1, hidden_dropout=0.0, attention_dropout=0.0,
        params_dtype=torch.bfloat16, bf16=True, normalization="RMSNorm", activation_func=F.silu,
        gated_linear_unit=True, qk_layernorm=True, attention_output_gate=True,
        experimental_attention_variant="gated_delta_net", linear_attention_freq=4, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32, linear_conv_kernel_dim=4)
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(0)  # weights initialised on the GPU (a CPU init of 1B parameters is slow)
    model = build_gpt_model(config, vocab_size=vocab, max_sequence_length=4096, rotary_percent=0.25).cuda().eval()
    print("\n3. end to end: 24-layer Qwen3-Next-shaped hybrid (18 GDN + 6 gated attention), hidden 2048, 1 MTP layer "
          "(S = 2 reruns it: mtp_reuse_last_layer), bf16, random weights (0 drafts accepted), CUDA graphs; median ms "
          "per decode step (whole step)")
    print(f"{'batch':>5} {'S':>2} {'step ms':>8} {'tok/s':>8}")
    for batch in batches:
        for S in (0, 2):
            inference = InferenceConfig(num_speculative_tokens=S, max_requests=max(batches), block_size_tokens=16,
                                        max_model_len=1024, max_tokens_per_step=2048,
                                        cuda_graph_batch_sizes=tuple(sorted({1, 8, max(batches)})),
                                        mtp_attention="paged", mtp_reuse_last_layer=True)
            controller = TextGenerationController(model, inference)
            times = timed_decode_steps(controller, batch, vocab, 128, max_new_tokens=400, warmup_steps=5, steps=steps)
            controller.close()
            ms = statistics.median(times)
            print(f"{batch:5d} {S:2d} {ms:8.2f} {batch / ms * 1e3:8.0f}")  # 1 token per request per step (none accepted)
    dist.destroy_process_group()


def main(args):
    if args.quick:
        device, shape = torch.device("cpu"), (2, 4, 16, 16)
        if args.tune:
            return tune_table(device, shape, (2,))
        decode_kernel_table(device, shape, (1, 4), (0, 2))
        prefill_table(device, shape, (64, 256))
        return
    device, shape = torch.device("cuda"), (16, 32, 128, 128)
    print(torch.cuda.get_device_name())
    if args.tune:
        return tune_table(device, shape, (32, 128))
    decode_kernel_table(device, shape, (1, 32, 128), (0, 2, 4))
    prefill_table(device, shape, (64, 256, 512, 1024, 4096, 8192))
    if not args.skip_e2e:
        end_to_end_table((1, 8, 32), steps=20)


if __name__ == "__main__":
    main(ARGS)
