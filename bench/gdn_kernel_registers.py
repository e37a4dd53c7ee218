"""Registers, spills and barriers of the GDN verify kernel (the deferred commit folded in) for an H100 (sm_90a), per
candidate launch shape of ``bench_gdn.py --tune``, compiled on a machine without a GPU: a static
look at what a shape costs before (or instead of) timing it.

    TRITON_INTERPRET=0 python bench/gdn_kernel_registers.py [--rows 1,3,5] [--root OTHER_CHECKOUT]

Qwen3-Next's shape (K = V = 128, 32 value heads over 16 key heads). Int arguments are typed as the
GPU's JIT types them (1 -> a constant, multiples of 16 marked divisible; ``num_rows`` as the kernel
asks); ``ptxas -v`` (Triton's own) gives registers and spills, ``nvdisasm`` the ``BAR.SYNC`` count.
``--root`` compiles another checkout's kernels (e.g. main's, for a baseline row).
"""

import argparse
import inspect
import os
import re
import subprocess
import sys
import tempfile

HEADS, KEY_HEADS, KEY_DIM, VALUE_DIM, SLOTS = 32, 16, 128, 128, 129
STORED_ROWS = 5  # 1 + S at S = 4: the pending rows a step may apply


def _int_values(kernel_name, rows):
    width = KEY_HEADS * KEY_DIM + HEADS * VALUE_DIM + HEADS  # [k | u | g] (main before gdn7: + 2 H; both 16-divisible)
    state = dict(states_s_head=KEY_DIM * VALUE_DIM, states_s_k=VALUE_DIM, states_s_v=1, key_dim=KEY_DIM,
                 value_dim=VALUE_DIM, heads=HEADS, key_heads=KEY_HEADS, inputs_s_slot=2 * STORED_ROWS * width,
                 inputs_s_parity=STORED_ROWS * width, inputs_s_row=width)
    return dict(state, num_rows=32 * rows, states_s_slot=HEADS * KEY_DIM * VALUE_DIM,
                q_stride_t=KEY_HEADS * KEY_DIM, q_stride_h=KEY_DIM, k_stride_t=KEY_HEADS * KEY_DIM,
                k_stride_h=KEY_DIM, v_stride_t=HEADS * VALUE_DIM, v_stride_h=VALUE_DIM, g_stride_t=HEADS,
                g_stride_h=1, beta_stride_t=HEADS, beta_stride_h=1, out_stride_t=HEADS * VALUE_DIM,
                out_stride_h=VALUE_DIM)


def _ptxas(tools):
    """The ptxas Triton compiles sm_90 with (triton 3.9: ``ptxas-blackwell``, whose PTX version the older
    ``ptxas`` beside it rejects), else the one in Triton's bin folder."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        return get_ptxas(90).path
    except (ImportError, TypeError, AttributeError):
        return os.path.join(tools, "ptxas")


def compile_and_count(kernel, kernel_name, rows, block_v, num_warps, schedule=None):
    """(registers a thread, spill bytes, BAR.SYNC count) of one launch shape (and row schedule:
    None = the table's at ``rows``)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from mtp_ctrl.triton_ops.gdn_tiles import gdn_row_schedule

    schedule = schedule or gdn_row_schedule(rows)
    values = _int_values(kernel_name, rows)
    unspecialised = set(getattr(kernel, "do_not_specialize", ()) or ())
    signature, constants, attrs = {}, dict(ROWS=rows, STORED_ROWS=STORED_ROWS, BLOCK_K=KEY_DIM, BLOCK_V=block_v), {}
    parameters = inspect.signature(kernel.fn).parameters
    constants.update({name: value for name, value in schedule.constants(rows, STORED_ROWS).items()
                      if name in parameters})  # --root: an older kernel has no schedule
    for index, name in enumerate(inspect.signature(kernel.fn).parameters):
        if name in constants:
            signature[name] = "constexpr"
        elif name.endswith("_PTR"):
            signature[name] = {"SLOTS_PTR": "*i64", "PENDING_PTR": "*i32", "PARITY_PTR": "*i32"}.get(name, "*fp32")
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif values[name] == 1 and name not in unspecialised and index not in unspecialised:
            signature[name], constants[name] = "constexpr", 1
        else:
            signature[name] = "i32"
            if values[name] % 16 == 0 and name not in unspecialised and index not in unspecialised:
                attrs[(index,)] = [["tt.divisibility", 16]]
    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs)
    options = dict(num_warps=num_warps, **({"maxnreg": schedule.max_registers} if schedule.max_registers else {}))
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as folder:
        ptx, cubin = os.path.join(folder, "k.ptx"), os.path.join(folder, "k.cubin")
        with open(ptx, "w") as handle:
            handle.write(compiled.asm["ptx"])
        with open(cubin, "wb") as handle:
            handle.write(compiled.asm["cubin"])
        report = subprocess.run([_ptxas(tools), "-arch=sm_90a", "-v", ptx, "-o", os.devnull],
                                capture_output=True, text=True).stderr
        sass = subprocess.run([os.path.join(tools, "nvdisasm"), "-c", cubin], capture_output=True, text=True).stdout
    registers = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores", report)
    return (int(registers.group(1)) if registers else -1, int(spills.group(1)) if spills else -1,
            sass.count("BAR.SYNC"))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,3,5", help="R = 1 + V values (after up to 5 pending rows)")
    parser.add_argument("--root", help="compile this checkout's kernels instead")
    parser.add_argument("--stored-rows", type=int, default=5,
                        help="P, the pending rows a step may apply (default 5: S = 4's)")
    parser.add_argument("--shapes", help="BLOCK_VxWARPS,... (default: every tune candidate)")
    parser.add_argument("--schedules", help="own/pending/ahead/q/maxreg,... row schedules (GDNRowSchedule; "
                                            "'all' = every row early; default: the table's at each R)")
    parser.add_argument("--verbose", action="store_true", help="show megatron-core's import-time warnings too")
    args = parser.parse_args()
    globals()["STORED_ROWS"] = args.stored_rows
    os.environ["TRITON_INTERPRET"] = "0"
    sys.path.insert(0, os.path.abspath(args.root or os.path.join(os.path.dirname(__file__), "..")))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import mtp_ctrl

    mtp_ctrl.quiet_known_warnings(args.verbose)
    import triton
    from bench_gdn import TUNE_CANDIDATES, parse_schedule, schedule_name
    from mtp_ctrl.triton_ops import gdn_replay

    print(f"triton {triton.__version__}, package {mtp_ctrl.__file__}; registers / spill bytes / BAR.SYNC")
    kernels = (("verify", gdn_replay._gdn_verify_rows_kernel),)
    shapes = (tuple(tuple(int(x) for x in shape.split("x")) for shape in args.shapes.split(","))
              if args.shapes else TUNE_CANDIDATES)
    schedules = [parse_schedule(text) for text in args.schedules.split(",")] if args.schedules else [None]
    for kernel_name, kernel in kernels:
        for rows in (int(value) for value in args.rows.split(",")):
            for block_v, num_warps in shapes:
                for schedule in schedules:
                    label = (f"{kernel_name} R = {rows} BLOCK_V {block_v:3d} x {num_warps} warps"
                             + (f" schedule {schedule_name(schedule)}" if schedule else ""))
                    try:
                        registers, spills, barriers = compile_and_count(kernel, kernel_name, rows, block_v,
                                                                        num_warps, schedule)
                        print(f"{label}: {registers} / {spills} / {barriers}", flush=True)
                    except Exception as error:  # report and go on: one shape's failure says nothing of the others
                        print(f"{label}: {type(error).__name__}: {str(error)[:200]}", flush=True)


if __name__ == "__main__":
    main()
