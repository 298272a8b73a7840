"""sparsecc.generation: greedy generation of exactly the tokens asked for, the first-token clock,
and the timing's numbers (positive, a decode rate only where there are decode steps)."""
import pytest
import torch

from sparsecc.errors import InputError
from sparsecc.generation import FirstTokenClock, greedy, greedy_loop, static_cache, time_generate, time_generate_each

from models import llama_lm


def test_greedy_makes_exactly_the_new_tokens_even_past_the_end_token():
    torch.manual_seed(0)
    model = llama_lm()
    ids = torch.randint(3, 256, (2, 5))
    free = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                          pad_token_id=0)
    # make the first generated token of row 0 the end-of-sequence token: a free run stops there
    model.generation_config.eos_token_id = int(free[0, 5])
    out = greedy(model, ids, new_tokens=8)
    assert out.shape == (2, 13) and torch.equal(out[:, :5], ids)
    assert int(out[0, 5]) != model.generation_config.eos_token_id       # suppressed until 8 tokens are made


def test_the_clock_stops_at_the_first_new_token():
    clock = FirstTokenClock(torch.device("cpu"))
    clock.put(torch.zeros(1, 5))                  # the prompt
    assert clock.first_token_at is None
    clock.put(torch.zeros(1))
    first = clock.first_token_at
    clock.put(torch.zeros(1))
    assert first is not None and clock.first_token_at == first


def test_time_generate_reports_the_first_token_and_the_decode_rate():
    torch.manual_seed(0)
    model = llama_lm()
    ids = torch.randint(3, 256, (3, 6))
    timing = time_generate(model, ids, new_tokens=4, repeats=2, warmup=0)
    assert timing.ttft_ms > 0 and timing.tokens_per_s > 0 and timing.sequences.shape == (3, 10)
    assert torch.equal(timing.sequences, greedy(model, ids, new_tokens=4))
    one = time_generate(model, ids, new_tokens=1, repeats=1, cache="static")
    assert one.ttft_ms > 0 and one.tokens_per_s is None and one.sequences.shape == (3, 7)
    with pytest.raises(InputError, match="new_tokens >= 1"):
        time_generate(model, ids, new_tokens=0)


def test_several_models_are_timed_in_turn_the_order_rotating():
    torch.manual_seed(0)
    first, second = llama_lm(), llama_lm()
    ids = torch.randint(3, 256, (2, 4))
    order = []
    first.register_forward_pre_hook(lambda *_: order.append("first"))
    second.register_forward_pre_hook(lambda *_: order.append("second"))
    timings = time_generate_each({"first": first, "second": second}, ids, new_tokens=1, repeats=3, warmup=0)
    assert list(timings) == ["first", "second"] and order == ["first", "second", "second", "first", "first", "second"]
    assert torch.equal(timings["first"].sequences, greedy(first, ids, new_tokens=1))


def test_a_static_cache_kept_across_calls_stays_in_place_and_generates_alike():
    """CUDA graphs need the cache's tensors where they were: one static cache, emptied before each
    call, gives each call the tokens of a fresh one, for other prompts too."""
    torch.manual_seed(0)
    model = llama_lm()
    ids = torch.randint(3, 256, (2, 6))
    cache = static_cache(model, 6 + 4)
    first = greedy(model, ids, new_tokens=4, cache=cache)
    where = [layer.keys.data_ptr() for layer in cache.layers]
    assert torch.equal(first, greedy(model, ids, new_tokens=4, cache="static"))
    assert torch.equal(greedy(model, ids, new_tokens=4, cache=cache), first)
    other = torch.randint(3, 256, (2, 6))
    assert torch.equal(greedy(model, other, new_tokens=4, cache=cache), greedy(model, other, new_tokens=4))
    assert [layer.keys.data_ptr() for layer in cache.layers] == where


@pytest.mark.parametrize("make", ["llama_lm", "gpt2_lm", "qwen2_lm", "mistral_lm"])
def test_the_greedy_loop_picks_generates_tokens(make):
    """Without an end-of-sequence token, the loop's tokens are greedy generate's, on the model and
    on its sparsecc-compiled 2:4 form (fp32: the same sums up to order), the prompt first; the
    LM head sees only each sequence's last position, the prompt's too (as in generate)."""
    import sparsecc
    import models
    torch.manual_seed(0)
    model = getattr(models, make)()
    model.generation_config.eos_token_id = None
    sparsecc.prune(model, "2:4", exclude=["*embed*", "*lm_head*", "*wte*", "*wpe*"])
    ids = torch.randint(3, 256, (2, 6))
    compiled = sparsecc.compile(model, ids, formats=("2:4",))
    want = greedy(model, ids, new_tokens=7)
    seen = []

    class Streamer:
        def put(self, value):
            seen.append(value.shape)

        def end(self):
            pass

    head_rows = []
    head = model.get_output_embeddings()
    head.register_forward_hook(lambda module, args, out: head_rows.append(args[0].shape[1]))
    for runner in (model, compiled):
        cache = static_cache(runner, 6 + 7)
        assert torch.equal(greedy_loop(runner, ids, new_tokens=7, cache=cache), want)
        assert torch.equal(greedy_loop(runner, ids, new_tokens=7, cache=cache, streamer=Streamer()), want)  # reused
    assert seen == ([(2, 6)] + [(2, 1)] * 7) * 2
    assert head_rows and set(head_rows) == {1}


def test_the_greedy_loop_refuses_what_it_cannot_do():
    torch.manual_seed(0)
    model = llama_lm()
    ids = torch.randint(3, 256, (1, 6))
    with pytest.raises(InputError, match="needs a cache object"):
        greedy_loop(model, ids, new_tokens=2, cache=None)
    with pytest.raises(InputError, match="holds 7 tokens per sequence; prompts of 6 and 2 new tokens need 8"):
        greedy_loop(model, ids, new_tokens=2, cache=static_cache(model, 7))
    with pytest.raises(InputError, match="at least one token"):
        greedy_loop(model, ids, new_tokens=0, cache=static_cache(model, 7))


def test_time_generate_times_the_greedy_loop_too():
    torch.manual_seed(0)
    model = llama_lm()
    model.generation_config.eos_token_id = None
    ids = torch.randint(3, 256, (2, 5))
    timing = time_generate(model, ids, new_tokens=4, cache="static", repeats=2, warmup=0, loop="greedy_loop")
    assert timing.ttft_ms > 0 and timing.tokens_per_s > 0
    assert torch.equal(timing.sequences, greedy(model, ids, new_tokens=4))
    with pytest.raises(InputError, match="the loops are"):
        time_generate(model, ids, new_tokens=4, loop="sample")
    with pytest.raises(InputError, match="without an attention mask"):
        time_generate(model, ids, torch.ones_like(ids), new_tokens=4, cache="static", loop="greedy_loop")
