"""Helpers for the megatron-core model tests: process groups, a tiny GPT, paged metadata, a dense oracle.

megatron's ``tensor_parallel.model_parallel_cuda_manual_seed`` needs CUDA (it asserts on a CPU
build of torch), so CPU tests seed with ``torch.manual_seed`` and build with
``use_cpu_initialization=True``: every TP size then draws the same master weights and shards them.
"""

import contextlib
import multiprocessing
import socket
from typing import List, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig

from mtp_ctrl.models import build_gpt_model
from mtp_ctrl.models.dense_attention import build_dense_gpt_model, dense_full_sequence  # noqa: F401 (re-exported)
from mtp_ctrl.state.attention_metadata import AttentionMetadata

VOCAB_SIZE = 96  # divisible by the TP size, as megatron requires (it pads vocabularies in training)
MAX_SEQUENCE_LENGTH = 128
BLOCK_SIZE_TOKENS = 4


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# What every spawned rank imports: a forkserver imports it once per test process and forks each
# rank from there (a freshly spawned interpreter spent ~9 CPU s importing torch and megatron-core).
RANK_PRELOAD = ("torch", "torch.distributed", "megatron.core", "mtp_ctrl.controllers", "mtp_ctrl.models",
                "tests.unit.megatron_fixtures")


def rank_process_context():
    """The multiprocessing context TP ranks start from: a forkserver that imports ``RANK_PRELOAD``."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(RANK_PRELOAD))  # no effect once the server runs
    return context


def spawn_ranks(worker, args=(), nprocs: int = 2) -> None:
    """``torch.multiprocessing.spawn(worker, args, nprocs)``, the ranks forked from
    ``rank_process_context()``; a rank's exception re-raises here, as with spawn."""
    rank_process_context()
    torch.multiprocessing.start_processes(worker, args=args, nprocs=nprocs, join=True, start_method="forkserver")


def init_process_groups(rank: int, world_size: int, port: int, tensor_parallel_size: int,
                        backend: str = "gloo") -> None:
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel_size)


def tiny_config(mtp_num_layers=2, tensor_parallel_size=1, **overrides) -> TransformerConfig:
    """2 layers, hidden 64, 4 query heads over 2 kv heads (GQA), fp32, no dropout."""
    fields = dict(
        num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
        mtp_num_layers=mtp_num_layers, hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=True, params_dtype=torch.float32, tensor_model_parallel_size=tensor_parallel_size,
    )
    fields.update(overrides)
    return TransformerConfig(**fields)


def build_tiny_model(config: TransformerConfig, seed: int = 1234):
    torch.manual_seed(seed)
    return build_gpt_model(config, VOCAB_SIZE, MAX_SEQUENCE_LENGTH).eval()


def build_dense_twin(config: TransformerConfig, paged_model) -> GPTModel:
    """The dense (SDPA causal attention) GPTModel holding the paged model's weights."""
    model = build_dense_gpt_model(config, VOCAB_SIZE, MAX_SEQUENCE_LENGTH)
    model.load_state_dict(paged_model.state_dict())
    return model.eval()


def allocate_kv_caches(num_layers, num_blocks, num_kv_heads_local, head_dim, dtype=torch.float32, device="cpu"):
    shape = (num_blocks, BLOCK_SIZE_TOKENS, num_kv_heads_local, head_dim)
    return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(num_layers)]


def make_metadata(block_tables: Sequence[Sequence[int]], chunks: Sequence[Tuple[int, int]], device="cpu"):
    """Metadata of one forward: request b runs ``q_len`` rows starting at position ``start``.

    ``chunks[b] = (start, q_len)``; ``block_tables[b]`` lists the request's KV block ids.
    Example: ``chunks = [(0, 3), (5, 2)]`` -> positions ``[0, 1, 2, 5, 6]``, seq_lens ``[3, 7]``.
    """
    max_blocks = max(len(table) for table in block_tables)
    block_table = torch.full((len(block_tables), max_blocks), -1, dtype=torch.int32)
    for request, table in enumerate(block_tables):
        block_table[request, :len(table)] = torch.tensor(table, dtype=torch.int32)
    positions = torch.cat([torch.arange(start, start + q_len) for start, q_len in chunks])  # [T] int64
    request_of_row = torch.cat([torch.full((q_len,), b) for b, (_, q_len) in enumerate(chunks)])  # [T]
    slots = block_table[request_of_row, positions // BLOCK_SIZE_TOKENS].long() * BLOCK_SIZE_TOKENS \
        + positions % BLOCK_SIZE_TOKENS  # [T] int64
    q_lens = torch.tensor([q_len for _, q_len in chunks])
    seq_lens = torch.tensor([start + q_len for start, q_len in chunks], dtype=torch.int32)
    return AttentionMetadata(
        query_start_loc=torch.cat([torch.zeros(1, dtype=torch.int64), q_lens.cumsum(0)]).int().to(device),
        seq_lens=seq_lens.to(device), slot_mapping=slots.to(device), block_table=block_table.to(device),
        positions=positions.to(device), num_actual_tokens=int(q_lens.sum()), max_query_len=int(q_lens.max()),
        max_seq_len=int(seq_lens.max()),
    )


def ensure_single_process_groups() -> None:
    """Initialise a 1-process gloo group with TP = 1 once per process (other test modules may share it)."""
    if not dist.is_initialized():
        init_process_groups(0, 1, free_port(), 1)
    elif not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)


# Two requests stepping through a mix of prefill chunks, single-row decodes and 1 + S = 3 row
# verifies; (start, q_len) per request per forward, (0, 0) = padding request.
SEQUENCE_LENGTHS = (13, 9)
BLOCK_TABLES = ([7, 2, 5, 0], [3, 6, 1])
SCHEDULE = (
    [(0, 5), (0, 3)],
    [(5, 1), (3, 6)],
    [(6, 3), (0, 0)],
    [(9, 1), (0, 0)],
    [(10, 3), (0, 0)],
)
NUM_BLOCKS = 8


def shifted_tokens(tokens: torch.Tensor, shift: int) -> torch.Tensor:
    """megatron's MTP input at depth ``shift - 1``: tokens rolled left by ``shift``, zeros at the end."""
    return torch.cat([tokens[shift:], torch.zeros(shift, dtype=tokens.dtype, device=tokens.device)])


@torch.no_grad()
def run_paged_schedule(runner, sequences: Sequence[torch.Tensor], kv_caches, device="cpu"):
    """Step the runner (decoder + every MTP depth) through SCHEDULE; logits per request, in position order.

    Returns ``(decoder_logits, mtp_logits)``: ``decoder_logits[b]`` is [n_b, V];
    ``mtp_logits[k][b]`` is [n_b, V] for depth k.
    """
    num_depths = runner.mtp_num_layers
    decoder_rows = [[] for _ in sequences]
    mtp_rows = [[[] for _ in sequences] for _ in range(num_depths)]
    for chunks in SCHEDULE:
        metadata = make_metadata(BLOCK_TABLES, chunks, device=device)
        token_ids = torch.cat([sequences[b][start:start + q_len] for b, (start, q_len) in enumerate(chunks)])
        logits, hidden = runner.forward(token_ids.to(device), metadata.positions, metadata, kv_caches)
        per_depth = []
        for depth in range(num_depths):
            next_ids = torch.cat([shifted_tokens(sequences[b], depth + 1)[start:start + q_len]
                                  for b, (start, q_len) in enumerate(chunks)])
            depth_logits, hidden = runner.mtp_forward(depth, hidden, next_ids.to(device), metadata.positions,
                                                      metadata, kv_caches)
            per_depth.append(depth_logits)
        row = 0
        for b, (_, q_len) in enumerate(chunks):
            decoder_rows[b].append(logits[row:row + q_len])
            for depth in range(num_depths):
                mtp_rows[depth][b].append(per_depth[depth][row:row + q_len])
            row += q_len
    decoder_logits = [torch.cat(rows) for rows in decoder_rows]
    mtp_logits = [[torch.cat(rows) for rows in depth_rows] for depth_rows in mtp_rows]
    return decoder_logits, mtp_logits


def random_sequences(seed: int = 0) -> List[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB_SIZE, (n,), generator=generator) for n in SEQUENCE_LENGTHS]


def tensor_parallel_worker(rank: int, world_size: int, port: int, expected_path: str, device_type: str) -> None:
    """One TP rank (spawned): the paged model's logits at TP = world_size equal the saved TP = 1 ones."""
    from mtp_ctrl.models import PagedGPTRunner, count_kv_layers

    if device_type == "cuda":
        torch.cuda.set_device(rank)
    init_process_groups(rank, world_size, port, world_size, backend="nccl" if device_type == "cuda" else "gloo")
    try:
        device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
        expected = torch.load(expected_path)
        model = build_tiny_model(tiny_config(mtp_num_layers=2, tensor_parallel_size=world_size)).to(device)
        runner = PagedGPTRunner(model)
        caches = allocate_kv_caches(count_kv_layers(model), NUM_BLOCKS, num_kv_heads_local=2 // world_size,
                                    head_dim=16, device=device)
        sequences = [tokens.to(device) for tokens in random_sequences(seed=0)]
        decoder_logits, mtp_logits = run_paged_schedule(runner, sequences, caches, device=device)
        tolerance = dict(atol=1e-3, rtol=1e-3) if device_type == "cuda" else dict(atol=1e-4, rtol=1e-4)
        for b in range(len(sequences)):
            torch.testing.assert_close(decoder_logits[b].cpu(), expected["decoder"][b], **tolerance)
            for depth in range(len(mtp_logits)):
                torch.testing.assert_close(mtp_logits[depth][b].cpu(), expected["mtp"][depth][b], **tolerance)
        bad_config = tiny_config(num_query_groups=1, tensor_parallel_size=world_size)
        try:
            build_tiny_model(bad_config)
        except ValueError as error:
            assert "num_query_groups" in str(error), error
        else:
            raise AssertionError("a model whose kv heads do not split over TP ranks was built")
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@contextlib.contextmanager
def torch_twins(*module_names: str):
    """Inside: every op runs its torch twin, not the interpreted kernel (each kernel == its twin in
    its own tests). For slow tests whose subject is the controller, and the processes they spawn.
    With names of ``mtp_ctrl.triton_ops`` modules, only their ops do (see ``MODEL_OPS``)."""
    import importlib

    from mtp_ctrl.triton_ops import _dispatch

    if not module_names:
        saved = _dispatch.interpreter_enabled
        _dispatch.interpreter_enabled = lambda: False
        try:
            yield
        finally:
            _dispatch.interpreter_enabled = saved
        return
    modules = [importlib.import_module(f"mtp_ctrl.triton_ops.{name}") for name in module_names]
    saved_choices = [module.use_triton for module in modules]
    for module in modules:
        module.use_triton = lambda tensor: tensor.is_cuda
    try:
        yield
    finally:
        for module, choice in zip(modules, saved_choices):
            module.use_triton = choice


MODEL_OPS = ("rope_kv_write", "paged_attn", "gumbel_sampling")
"""The target model's attention and rope and the sampler: ~90 % of an interpreted controller loop's
time (the rope kernel alone ~2/3). A loop test whose subject is a proposer's or a step's own kernels
runs these on their twins (``model_twins``); ``test_overlap``'s padded churn interprets them all."""
