"""Load time and peak host memory of a Hugging Face checkpoint: load_hf_checkpoint vs transformers' from_pretrained.

Model (default, ``--shape 8b``): Llama-3-8B's shape (32 layers, hidden 4096, ffn 14336, 32 query
heads over 8 KV heads, vocab 128256, untied, llama3 rope scaling; 8.0 B parameters, 16.1 GB in
bf16), random weights drawn on the device and written by ``save_pretrained`` (safetensors shards
+ index) into ``--dir`` unless it already holds a checkpoint. ``--shape small``: 4 layers, hidden
1024 (a CPU smoke run). Then, in this order (each load into a fresh model, the previous freed):

- ``ours``: ``mtp_ctrl.models.load_hf_checkpoint(dir, device=...)`` (bf16 on the device);
- ``transformers``: ``AutoModelForCausalLM.from_pretrained(dir, dtype=bf16, device_map=device)``
  (without ``accelerate``, which ``device_map`` needs: ``from_pretrained(...).to(device)``);

``--repeats`` times, alternating. The files were just written or read, so they come from the page
cache (a warm load). Timed from the call to the last byte on the device (CUDA synchronised).
Memory: a thread samples this process's ``/proc/self/status`` every 5 ms; reported is the peak
over the load of anonymous memory (``RssAnon``: what the process allocated; mapped file pages
are ``RssFile``, reported apart) minus its value before the load, and the peak GPU memory.

    python bench/bench_hf_load.py                                   # H100: write + load an 8B-shaped Llama-3
    python bench/bench_hf_load.py --shape small --device cpu        # smoke run on a CPU
"""

import argparse
import gc
import json
import os
import statistics
import sys
import threading
import time

SHAPES = {
    "8b": dict(num_hidden_layers=32, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256),
    "small": dict(num_hidden_layers=4, hidden_size=1024, intermediate_size=3584, num_attention_heads=8,
                  num_key_value_heads=2, vocab_size=32000),
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--dir", default="/tmp/hf_bench_checkpoint", help="checkpoint directory (written if empty)")
    parser.add_argument("--repeats", type=int, default=2, help="loads per path, alternating")
    parser.add_argument("--verbose", action="store_true", help="show megatron-core's import-time warnings too")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    return args


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


class PeakMemory:
    """Peak RssAnon / RssFile (GiB above the start) while the ``with`` block runs."""

    def __enter__(self):
        self.start_anon, self.start_file = _status_kib("RssAnon"), _status_kib("RssFile")
        self.peak_anon, self.peak_file = self.start_anon, self.start_file
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.005):
            self.peak_anon = max(self.peak_anon, _status_kib("RssAnon"))
            self.peak_file = max(self.peak_file, _status_kib("RssFile"))

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.anon_gib = (self.peak_anon - self.start_anon) / 2**20
        self.file_gib = (self.peak_file - self.start_file) / 2**20


def write_checkpoint(args, torch):
    from transformers import LlamaConfig, LlamaForCausalLM

    if os.path.isfile(os.path.join(args.dir, "config.json")):
        print(f"using the checkpoint in {args.dir}")
        return
    config = LlamaConfig(**SHAPES[args.shape], max_position_embeddings=8192, rms_norm_eps=1e-5,
                         tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001,
                         rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 8192})
    started = time.perf_counter()
    torch.manual_seed(0)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(args.device):
        model = LlamaForCausalLM(config)
    torch.set_default_dtype(default_dtype)
    model.save_pretrained(args.dir)
    size = sum(os.path.getsize(os.path.join(args.dir, f)) for f in os.listdir(args.dir)) / 1e9
    print(f"wrote {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters ({size:.1f} GB) to "
          f"{args.dir} in {time.perf_counter() - started:.1f} s", flush=True)
    del model
    gc.collect()


def main(args):
    import torch

    import mtp_ctrl

    device = torch.device(args.device)
    write_checkpoint(args, torch)
    mtp_ctrl.init_single_process(device)
    from transformers import AutoModelForCausalLM

    from mtp_ctrl.models import load_hf_checkpoint

    import importlib.util

    if importlib.util.find_spec("accelerate") is not None:  # transformers loads straight onto the device
        def from_pretrained():
            return AutoModelForCausalLM.from_pretrained(args.dir, dtype=torch.bfloat16, device_map=str(device))
        how = f"from_pretrained(dtype=bf16, device_map={str(device)!r})"
    else:  # without accelerate transformers takes no device_map: it loads on the CPU, then .to(device)
        def from_pretrained():
            return AutoModelForCausalLM.from_pretrained(args.dir, dtype=torch.bfloat16).to(device)
        how = "from_pretrained(dtype=bf16).to(device) (no accelerate: no device_map)"
    print(f"transformers path: {how}")
    loaders = {
        "ours": lambda: load_hf_checkpoint(args.dir, device=device, dtype=torch.bfloat16),
        "transformers": from_pretrained,
    }
    results = {name: [] for name in loaders}
    for _ in range(args.repeats):
        for name, load in loaders.items():
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            try:
                with PeakMemory() as memory:
                    started = time.perf_counter()
                    model = load()
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    seconds = time.perf_counter() - started
            except Exception:  # one path failing still reports the other
                import traceback

                traceback.print_exc()
                continue
            gpu_gib = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
            results[name].append(dict(seconds=seconds, host_anon_gib=memory.anon_gib, host_file_gib=memory.file_gib,
                                      gpu_gib=gpu_gib))
            print(f"{name:13} {seconds:7.2f} s  peak host +{memory.anon_gib:6.2f} GiB anon, "
                  f"+{memory.file_gib:6.2f} GiB file-mapped; peak GPU {gpu_gib:6.2f} GiB", flush=True)
            del model
    print(f"\n{'':13}{'median s':>10}{'host anon GiB':>15}{'GPU GiB':>10}")
    for name, runs in results.items():
        if not runs:
            print(f"{name:13} failed")
            continue
        print(f"{name:13}{statistics.median(r['seconds'] for r in runs):10.2f}"
              f"{max(r['host_anon_gib'] for r in runs):15.2f}{max(r['gpu_gib'] for r in runs):10.2f}")
    print(json.dumps({"shape": args.shape, "device": str(device), "results": results}))


if __name__ == "__main__":
    ARGS = parse_args()  # --help answers before torch loads
    import mtp_ctrl

    mtp_ctrl.quiet_known_warnings(ARGS.verbose)
    sys.exit(main(ARGS))
