"""Helpers of the prefix-caching tests: prompts sharing partial prefixes, a staggered run loop."""

import random

from tests.unit.megatron_fixtures import VOCAB_SIZE

SYSTEM = [7, 21, 3, 88, 45, 12, 9, 60, 33, 2, 71, 14, 5, 90, 27, 41, 18, 66]  # 18 tokens: 4 full blocks of 4


def shared_prompts(count: int, seed: int = 0, vocab_size: int = VOCAB_SIZE):
    """Prompts sharing partial prefixes of SYSTEM (some the whole of it), with distinct tails."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        shared = [token % vocab_size for token in SYSTEM[: rng.choice([0, 5, 9, 13, 18, 18])]]
        prompts.append(shared + [rng.randrange(vocab_size) for _ in range(rng.randint(1, 5))])
    return prompts


def run_staggered(controller, prompts, params, stagger: int = 2):
    """Add a request every ``stagger`` steps (so later ones find earlier ones' blocks cached);
    returns [(output tokens, decode steps, accepted drafts)] in prompt order."""
    ids, pending, step = [], list(zip(prompts, params)), 0
    while pending or controller.has_unfinished_requests():
        if pending and step % stagger == 0:
            prompt, param = pending.pop(0)
            ids.append(controller.add_request(prompt, param))
        controller.step()
        step += 1
    results = [controller.result(request_id) for request_id in ids]
    return [(r.output_tokens, r.decode_steps, r.accepted_drafts) for r in results]


def assert_hits_and_no_leak(controller):
    stats = controller.metrics.as_dict()["prefix_cache"]
    assert stats["hit_tokens"] > 0 and 0 < stats["hit_rate"] < 1 and stats["cached_blocks"] > 0
    pool = controller.context.allocator
    assert pool.num_free_blocks == pool.num_blocks
