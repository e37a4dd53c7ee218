"""Compile kernels for an H100 (sm_90) on a machine without a GPU; run as a script with
``TRITON_INTERPRET=0`` (under the interpreter ``triton.jit`` makes no compilable kernels).

The interpreter runs a kernel's Python with every int argument a plain value, but on the GPU
Triton specialises an int argument equal to 1 into a constant, which has no tensor methods
(``n.to(tl.int64)`` then fails to compile). So each kernel is compiled twice: with its int
arguments as ``i32``, and with all of them the constant 1 (but those the kernel marks
``do_not_specialize``, which the JIT never specialises). Prints one line per failure (a
``CompilationError``: the kernel's code) and exits 1 if any; prints ``skip: ...`` and exits 0
when this machine's Triton cannot compile for sm_90 (any other error).

    TRITON_INTERPRET=0 python tests/unit/hopper_compile_check.py [gluon_gdn|rest]

``gluon_gdn`` compiles the Gluon MLA kernels and the GDN kernels, ``rest`` every other kernel, no
argument both: the unit test runs the two halves as two tests, so two workers share them.

Only the front end runs (the kernel's Python to Triton IR, where a ``CompilationError`` comes from,
and the TTIR passes; Gluon: its IR): the later stages (layouts, LLVM, ptxas) took ~95 % of the
check's ~170 CPU s, and it never counted their errors as the kernel's (any error other than a
``CompilationError`` reads as this machine's toolchain: a skip). The GPU tests compile and run those.
"""

import sys


class _FrontEndDone(Exception):
    """Raised in place of the first stage after the front end's: the check needs no more."""


def _stop_after_front_end(*args):
    """``knobs.runtime.add_stages_inspection_hook``: called bare, the key and hash it adds to the
    cache's; with ``(backend, stages, options, language, capability)``, it keeps the first stage and
    ends the compile there."""
    if not args:
        return "front_end_only", "front_end_only"
    stages = args[1]

    def done(module, metadata):
        raise _FrontEndDone

    for name in list(stages)[1:]:
        stages[name] = done


def compile_for_hopper(kernel, pointer_types, float_args, constexprs, ints_as_one, num_warps=4):
    """Gluon kernels (``kernel.is_gluon()``) compile from their own AST source, with their pointers
    16-byte aligned (as Triton specialises aligned pointers at run time: their ``cp.async`` copies
    need it) and the ``num_warps`` their layouts are written for."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constants = {}, dict(constexprs)
    for param in kernel.params:
        if param.is_constexpr:
            signature[param.name] = "constexpr"
        elif param.name in pointer_types:
            signature[param.name] = "*" + pointer_types[param.name]
        elif param.name in float_args:
            signature[param.name] = "fp32"
        elif ints_as_one and not param.do_not_specialize:  # the JIT never makes those constants
            signature[param.name], constants[param.name] = "constexpr", 1
        else:
            signature[param.name] = "i32"
    target = GPUTarget("cuda", 90, 32)
    try:
        if getattr(kernel, "is_gluon", lambda: False)():
            from triton.experimental.gluon._runtime import GluonASTSource

            aligned = {(index,): [["tt.divisibility", 16]] for index, param in enumerate(kernel.params)
                       if param.name in pointer_types}
            triton.compile(GluonASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=aligned),
                           target=target, options=dict(num_warps=num_warps))
        else:
            triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constants), target=target)
    except _FrontEndDone:
        pass


def pointers(kernel, default, **special):
    """Every ``*_PTR`` argument of ``kernel`` typed ``default`` unless named in ``special``."""
    types = {param.name: default for param in kernel.params if param.name.endswith("_PTR")}
    types.update(special)
    return types


def cases():
    """(label, kernel, pointer types, float args, constexprs[, compile options]): the kernels of a
    decode step's attention and glue, and the Mamba prefill kernels, in the variants the models
    launch."""
    from mtp_ctrl.triton_ops import (gdn_recurrent, gdn_replay, layer_glue, mamba_varlen, mla_attention, moe_gemm,
                                     paged_attn, rejection_sampling, rope_kv_write, sampling_filter)

    attention = paged_attn._paged_attention_kernel
    attention_pointers = pointers(attention, "bf16", BLOCK_TABLE_PTR="i32", SEQ_LENS_PTR="i32",
                                  QUERY_START_LOC_PTR="i32", PARTIAL_ACC_PTR="fp32", PARTIAL_MAX_PTR="fp32",
                                  PARTIAL_SUM_PTR="fp32")
    for splits, flat, block_q in ((1, False, 1), (4, False, 1), (1, True, 32)):
        yield (f"paged attention, {splits} splits{', flat tiles' if flat else ''}", attention, attention_pointers,
               {"qk_scale"}, dict(BLOCK_Q=block_q, BLOCK_M=max(16, block_q * 2), BLOCK_N=64, BLOCK_D=128,
                                  NUM_KV_SPLITS=splits, DOT_PRECISION="tf32", ZERO_BLOCK=paged_attn._ZERO_BLOCK,
                                  FLAT_TILES=flat))
    combine = paged_attn._combine_kv_splits_kernel
    yield ("attention merge", combine, pointers(combine, "fp32", QUERY_START_LOC_PTR="i32", OUTPUT_PTR="bf16"), set(),
           dict(BLOCK_R=8, BLOCK_DC=128, SPLIT_CHUNK=4))
    mla = mla_attention._paged_mla_kernel
    mla_pointers = pointers(mla, "bf16", BLOCK_TABLE_PTR="i32", SEQ_LENS_PTR="i32", QUERY_START_LOC_PTR="i32",
                            PARTIAL_ACC_PTR="fp32", PARTIAL_MAX_PTR="fp32", PARTIAL_SUM_PTR="fp32")
    # DeepSeek-V3's latent (512 + 64), 16 heads, one decode row a request; the split count is a
    # runtime int (= 1 here when ints are constants: the one-split path)
    yield ("paged MLA attention", mla, mla_pointers, {"qk_scale"},
           dict(BLOCK_Q=1, BLOCK_H=16, BLOCK_M=16, BLOCK_N=32, BLOCK_C=512, BLOCK_R=64, DOT_PRECISION="tf32",
                ZERO_BLOCK=mla_attention._ZERO_BLOCK, FULL_DIMS=False, FLAT_TILES=False))
    # a verify (1 + S = 3 rows x 16 heads in one 64-row tile), no column masks; and the flat grid of
    # a step with prefill chunks (requests of several such tiles)
    for flat in (False, True):
        yield (f"paged MLA attention, 64-row verify tile{', flat tiles' if flat else ''}", mla, mla_pointers,
               {"qk_scale"}, dict(BLOCK_Q=4, BLOCK_H=16, BLOCK_M=64, BLOCK_N=64, BLOCK_C=512, BLOCK_R=64,
                                  DOT_PRECISION="tf32", ZERO_BLOCK=mla_attention._ZERO_BLOCK, FULL_DIMS=True,
                                  FLAT_TILES=flat))
    try:  # the Gluon kernel of 64 / 128 heads (a Triton without Gluon: not built, nothing to check)
        from mtp_ctrl.triton_ops import mla_wgmma
    except (ImportError, AttributeError):
        mla_wgmma = None
    if mla_wgmma is not None:
        gluon_mla = mla_wgmma._paged_mla_wgmma_kernel
        # decode rows at >= 64 heads; a verify tile (3 rows x 16); each in both schedules
        for block_q, block_h, async_dots in ((1, 64, False), (1, 64, True), (4, 16, False), (4, 16, True)):
            yield (f"paged MLA attention, Gluon (sm_90), {block_q} x {block_h} rows, async dots {async_dots}",
                   gluon_mla,
                   pointers(gluon_mla, "bf16", BLOCK_TABLE_PTR="i32", SEQ_LENS_PTR="i32", QUERY_START_LOC_PTR="i32",
                            PARTIAL_ACC_PTR="fp32", PARTIAL_MAX_PTR="fp32", PARTIAL_SUM_PTR="fp32"), {"qk_scale"},
                   dict(BLOCK_Q=block_q, BLOCK_H=block_h, ZERO_BLOCK=mla_attention._ZERO_BLOCK,
                        ASYNC_DOTS=async_dots),
                   dict(num_warps=mla_wgmma.NUM_WARPS))
        try:
            from mtp_ctrl.triton_ops import mla_wgmma_ws
        except (ImportError, AttributeError):
            mla_wgmma_ws = None
        if mla_wgmma_ws is not None:
            ws_mla = mla_wgmma_ws._paged_mla_ws_kernel
            for block_q, block_h in ((1, 64), (4, 16)):
                yield (f"paged MLA attention, Gluon warp-specialized (sm_90), {block_q} x {block_h} rows", ws_mla,
                       pointers(ws_mla, "bf16", BLOCK_TABLE_PTR="i32", SEQ_LENS_PTR="i32", QUERY_START_LOC_PTR="i32",
                                PARTIAL_ACC_PTR="fp32", PARTIAL_MAX_PTR="fp32", PARTIAL_SUM_PTR="fp32"), {"qk_scale"},
                       dict(BLOCK_Q=block_q, BLOCK_H=block_h, ZERO_BLOCK=mla_attention._ZERO_BLOCK),
                       dict(num_warps=mla_wgmma_ws.PARTITION_WARPS))
    latent_write = mla_attention._rope_write_latent_kernel
    yield ("rope + latent write", latent_write,
           pointers(latent_write, "bf16", SLOT_MAPPING_PTR="i64", COS_PTR="fp32", SIN_PTR="fp32"), set(),
           dict(BLOCK_H=16, BLOCK_C=512, BLOCK_R=64))
    rope = rope_kv_write._rope_write_kv_cache_kernel
    for has_bias, has_rotary in ((True, True), (False, True), (True, False)):
        yield (f"rope + KV write, bias {has_bias}, rotary {has_rotary}", rope,
               pointers(rope, "bf16", SLOT_MAPPING_PTR="i64", COS_PTR="fp32", SIN_PTR="fp32"), set(),
               dict(HAS_ROTARY=has_rotary, HAS_BIAS=has_bias, ROUND_BF16=True, INTERLEAVED=False, BLOCK_G=4,
                    BLOCK_D=128))
    norm = layer_glue._add_bias_residual_norm_kernel
    yield ("bias + residual + norm", norm, pointers(norm, "bf16"), {"eps"},
           dict(HAS_BIAS=True, HAS_NORM=True, HAS_NORM_BIAS=True, RMS_NORM=False, ROUND_BF16=True, BLOCK_H=2048))
    gated_norm = layer_glue._gated_rms_norm_kernel
    yield ("gated RMS norm (Mamba mixer)", gated_norm, pointers(gated_norm, "fp32", WEIGHT_PTR="bf16", OUT_PTR="bf16"),
           {"eps"}, dict(ROUND_BF16=True, BLOCK_G=512))
    scan = mamba_varlen._ssm_varlen_scan_kernel
    for in_place, stages in ((False, 1), (True, 1), (True, 4)):
        yield (f"SSM varlen scan, in place {in_place}, {stages} stages", scan,
               pointers(scan, "fp32", SLOT_IDS_PTR="i64", ROW_START_PTR="i64", ROW_COUNT_PTR="i64"), set(),
               dict(BLOCK_P=4, BLOCK_N=128, BLOCK_ROWS=16, IN_PLACE=in_place, STAGES=stages))
    conv = mamba_varlen._causal_conv_varlen_kernel
    for has_slots in (False, True):
        yield (f"causal conv varlen, slots {has_slots}", conv,
               pointers(conv, "fp32", SLOT_IDS_PTR="i64", ROW_START_PTR="i64", ROW_COUNT_PTR="i64"), set(),
               dict(WIDTH=4, SEARCH_STEPS=4, BLOCK_ROWS=16, BLOCK_CHANNELS=128, BLOCK_HISTORY=4, HAS_SLOTS=has_slots))
    gdn = gdn_recurrent._gdn_rows_kernel
    for decode in (True, False):  # Qwen3-Next's GDN heads: K = 128, V tiles of 32; verify rows of S = 2
        yield (f"GDN rows, decode {decode}", gdn,
               pointers(gdn, "fp32", SLOTS_PTR="i64", ROW_START_PTR="i64", ROW_COUNT_PTR="i64"), set(),
               dict(DECODE=decode, ROWS=3, BLOCK_K=128, BLOCK_V=32))
    verify = gdn_replay._gdn_verify_rows_kernel
    # plain decoding (state in place), verify rows of S = 2 (inputs stored; 3 pending) and of S = 4 (5
    # pending), each under its table's row schedule
    for rows, stored in ((1, 3), (3, 3), (5, 5)):
        schedule = gdn_replay.gdn_row_schedule(rows).constants(rows, stored)
        yield (f"GDN verify rows, R = {rows}", verify,
               pointers(verify, "fp32", SLOTS_PTR="i64", PENDING_PTR="i32", PARITY_PTR="i32"), set(),
               dict(ROWS=rows, STORED_ROWS=stored, BLOCK_K=128, BLOCK_V=32, **schedule))
    mark = gdn_replay._gdn_mark_pending_rows_kernel
    yield ("GDN pending rows", mark, pointers(mark, "i64", PENDING_PTR="i32", PARITY_PTR="i32"), set(),
           dict(ROWS=3, BLOCK=128))

    probs = sampling_filter._sampling_probs_kernel
    yield ("sampling probs (rejection acceptance)", probs,
           pointers(probs, "fp32", LOGITS_PTR="bf16", TOP_K_PTR="i64"), set(),
           dict(GREEDY_TEMPERATURE=1e-5, NUM_PIVOTS=16, BLOCK_VOCAB=256))
    rejection = rejection_sampling._rejection_sample_kernel
    for has_q in (True, False):
        yield (f"rejection sample, q {has_q}", rejection,
               pointers(rejection, "i64", LOGITS_PTR="bf16", DRAFT_LOGITS_PTR="fp32", TEMPERATURE_PTR="fp32",
                        TOP_P_PTR="fp32"), set(),
               dict(GREEDY_TEMPERATURE=1e-5, HAS_Q=has_q, NUM_PIVOTS=16, BLOCK_VOCAB=256))
    counts = moe_gemm._chunk_bucket_counts_kernel
    yield ("MoE pair counts", counts, pointers(counts, "i64", CHUNK_COUNTS_PTR="i32"), set(), dict(BLOCK_P=64, E_PAD=128))
    layout = moe_gemm._segment_layout_kernel
    yield ("MoE segment layout", layout, pointers(layout, "i64", CHUNK_COUNTS_PTR="i32", CHUNK_BASES_PTR="i32"), set(),
           dict(BLOCK_ROWS=16, BLOCK_C=16, BLOCK_B=64, E_PAD=128))
    place = moe_gemm._place_pairs_kernel
    yield ("MoE pair placement", place, pointers(place, "i64", CHUNK_BASES_PTR="i32"), set(), dict(BLOCK_P=64, E_PAD=128))
    matmul = moe_gemm._grouped_expert_matmul_kernel
    for gather, scatter in ((True, False), (False, True)):
        yield (f"MoE grouped expert matmul, gather {gather}, scatter {scatter}", matmul,
               pointers(matmul, "i64", ROWS_PTR="bf16", WEIGHT_PTR="bf16", OUT_PTR="bf16"), set(),
               dict(GATHER_ROWS=gather, SCATTER_PAIRS=scatter, FP32_DOT=False, BLOCK_M=16, BLOCK_N=64, BLOCK_K=64))


def _summary(error: Exception) -> str:
    """The error's message line, or else the source line Triton's caret points at."""
    lines = [line for line in str(error).splitlines() if line.strip() and set(line.strip()) != {"^"}]
    named = [line.strip() for line in lines if "Error" in line]
    if named:
        return named[-1]
    return f"{type(error).__name__} at: {lines[-1].strip()}" if lines else type(error).__name__


GROUPS = ("gluon_gdn", "rest")


def group_of(label: str) -> str:
    """Which half of the check a case belongs to (the two take similar compile time)."""
    return "gluon_gdn" if label.startswith(("paged MLA attention, Gluon", "GDN")) else "rest"


def main(group=None) -> int:
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
        from triton.compiler.errors import CompilationError
    except ImportError as error:
        print(f"skip: this Triton has no ahead-of-time compiler API ({error})")
        return 0
    from triton import knobs

    if hasattr(knobs.runtime, "add_stages_inspection_hook"):  # else (an older Triton) every stage runs
        knobs.runtime.add_stages_inspection_hook = _stop_after_front_end
    failures = 0
    for label, kernel, pointer_types, float_args, constexprs, *options in cases():
        if group is not None and group_of(label) != group:
            continue
        for ints_as_one in (False, True):
            try:
                compile_for_hopper(kernel, pointer_types, float_args, constexprs, ints_as_one, **dict(*options))
            except Exception as error:  # report every failing variant, not just the first
                if not isinstance(error, CompilationError):  # not the kernel's code: this machine's toolchain
                    print(f"skip: cannot compile for sm_90 here ({type(error).__name__}: {_summary(error)})")
                    return 0
                failures += 1
                print(f"FAIL {label}, int arguments {'= 1 (constants)' if ints_as_one else 'as i32'}: "
                      f"{_summary(error)}")
    return 1 if failures else 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] not in GROUPS:
        sys.exit(f"usage: hopper_compile_check.py [{'|'.join(GROUPS)}]")
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else None))
