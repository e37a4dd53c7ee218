"""BatchDimensions: ordering, the CUDA-graph bucket rounding, and its use as the graph key."""

import pytest

from mtp_ctrl.state import BatchDimensions, round_up_batch_size
from mtp_ctrl.state.batch_dimensions import check_batch_sizes, check_token_counts, token_buckets


def test_decode_only_dimensions():
    dims = BatchDimensions.decode_only(batch_size=4, num_speculative_tokens=2)
    assert dims == BatchDimensions(token_count=12, request_count=4, has_prefill=False)


def test_ordering_and_hashing():
    small = BatchDimensions.decode_only(2, 1)
    large = BatchDimensions.decode_only(8, 1)
    mixed = BatchDimensions(token_count=3, request_count=2, has_prefill=True)
    assert sorted([large, mixed, small]) == [mixed, small, large]  # by token count first
    graphs = {small: "graph-2"}
    assert graphs[BatchDimensions.decode_only(2, 1)] == "graph-2"


@pytest.mark.parametrize(
    "batch_size, expected", [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (8, 8), (9, None)]
)
def test_round_up_batch_size(batch_size, expected):
    assert round_up_batch_size(batch_size, (1, 2, 4, 8)) == expected


def test_token_buckets():
    assert token_buckets(256) == (64, 128, 256)
    assert token_buckets(200) == (64, 128, 200)
    assert token_buckets(64) == (64,)
    assert token_buckets(48) == (48,)
    # quarter-octave steps from 256 to 4096 rows (a queue's mixed steps land there), powers of two around
    assert token_buckets(1024) == (64, 128, 256, 320, 384, 448, 512, 640, 768, 896, 1024)
    assert token_buckets(16384) == (64, 128, 256, 320, 384, 448, 512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048,
                                    2560, 3072, 3584, 4096, 8192, 16384)
    assert token_buckets(16384, per_octave=1) == (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
    assert token_buckets(300) == (64, 128, 256, 300)
    assert check_token_counts([16, 48], 64) == (16, 48)
    for bad in ([48, 16], [0, 16], [16, 65], [16, True]):
        with pytest.raises(ValueError, match="cuda_graph_token_counts"):
            check_token_counts(bad, 64)


def test_round_up_without_buckets():
    assert round_up_batch_size(1, ()) is None


def test_check_batch_sizes():
    assert check_batch_sizes([1, 2, 4], max_requests=4) == (1, 2, 4)
    with pytest.raises(ValueError, match="strictly increasing"):
        check_batch_sizes((2, 1), max_requests=4)
    with pytest.raises(ValueError, match="strictly increasing"):
        check_batch_sizes((2, 2), max_requests=4)
    with pytest.raises(ValueError, match=r"in \[1, 4\]"):
        check_batch_sizes((1, 8), max_requests=4)
    with pytest.raises(ValueError, match=r"in \[1, 4\]"):
        check_batch_sizes((0,), max_requests=4)


def test_the_controller_keys_its_cuda_graphs_by_batch_dimensions(torch_twins):
    """The role BatchDimensions plays: a decode-only step of 3 requests padded to the bucket of 4
    replays the graph keyed (BatchDimensions.decode_only(4, S), all greedy, 1 step); the first step, three
    prompts, pads to 4 requests and the next token bucket. (The keys are the subject, not the
    kernels: torch twins.)"""
    from mtp_ctrl.controllers import SamplingParams
    from tests.unit.controller_fixtures import PROMPTS, build_models, make_controller
    from tests.unit.megatron_fixtures import ensure_single_process_groups

    ensure_single_process_groups()
    model, _ = build_models()
    controller = make_controller(model, 2, cuda_graph_batch_sizes=(2, 4))
    keys = []
    controller.on_launch = lambda step, graph_key: keys.append(graph_key)  # the documented debug hook
    controller.generate([list(prompt) for prompt in PROMPTS[:3]], SamplingParams(max_new_tokens=3))
    prefill_dims = keys[0][0]
    total_prompt = sum(len(prompt) for prompt in PROMPTS[:3])
    assert prefill_dims.has_prefill and prefill_dims.request_count == 4
    assert prefill_dims.token_count == round_up_batch_size(total_prompt, token_buckets(controller.config.max_tokens_per_step))
    # (shape, all greedy, steps per launch, verify width, draft depths, draft lengths masked, the
    # proposer's plan): fixed S = 2; paged MTP's plan of a drafting step with no skipped window is
    # ((2, 0),): every depth run, no catch-up rows (controllers/mtp_catch_up.py)
    assert (BatchDimensions.decode_only(4, 2), True, 1, 2, 2, False, ((2, 0),)) in keys
