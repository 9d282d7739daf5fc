#!/usr/bin/env python3
"""A serving engine's loop on flashmonoid, end to end: a Llama model from transformers whose
attention runs on a paged KV cache, as vLLM- and SGLang-style servers hold it.

- The cache: per layer, a pool of pages of `--page-size` tokens (num_pages, page_size, h_k, d),
  handed to the sequences in a shuffled order through a block table, poisoned with NaN so that a
  read of a row nobody wrote shows in the logits.
- Prefill: the prompts (different lengths) packed into one varlen batch; the engine rotates q and k
  and writes k and v into the pages itself, then `flash_attn_varlen_func(..., block_table=...)`
  attends over the pages.
- Decoding: every layer is one `flash_attn_with_kvcache` call that rotates q and the new k, appends
  the new k and v into the right page and attends, with `cache_seqlens` on the device (advanced
  in place after the last layer). On a GPU the whole step (embedding, layers, logits) is captured
  once in a CUDA graph and replayed for every token: no host synchronisation between tokens.
- Speculative decoding (`--draft N`): each step feeds N tokens per sequence (the next one and N - 1
  guesses of a low-precision copy of the model), causal among them; the first guess the logits
  disagree with and every guess after it are dropped by moving `cache_seqlens` back, and the next
  step writes over their rows.
- flash-attn 3's form (`--engine fa3_packed`): the same pages, the engine rotating q and k and
  writing k and v itself, every attention (prefill and decoding) one
  `flashmonoid.flash_attn3_interface.flash_attn_with_kvcache` call with packed queries
  (cu_seqlens_q) over the keys in the cache, as SGLang's flash-attn 3 backend makes it.
- vLLM's form (`--engine vllm`): the same, every attention one
  `flashmonoid.vllm_flash_attn.flash_attn_varlen_func` call with seqused_k and the block table into
  a preallocated output, as vLLM's FlashAttention backend makes it.
- Baseline (`--engine sdpa` or `both`): the same loop with transformers' static cache (contiguous,
  head-major, zeros) and torch's scaled_dot_product_attention with a mask over its whole capacity.
- Check: the model's own forward (transformers, its SDPA attention, no cache) over the generated
  sequences gives the logits every step should have produced; the loop's error against the model in
  float64 must be at most twice that of the model run in the loop's dtype (the FlashAttention rule,
  applied to the logits). Afterwards the pages must hold finite rows exactly at the sequences'
  positions and the poison everywhere else.

    python examples/serving_loop.py                  # CUDA (bf16, CUDA graph) if present, else CPU (fp32)
    python examples/serving_loop.py --device cpu --dtype bf16 --steps 40
    python examples/serving_loop.py --draft 4        # speculative: 4 tokens per step
    python examples/serving_loop.py --engine both --batch 32 --context 4096   # against SDPA's static cache

Needs torch, transformers and flashmonoid. tests/python/test_serving_loop.py runs `run()` small.
"""

import argparse
import copy
import time

import torch

from flashmonoid import flash_attn3_interface as fa3
from flashmonoid import vllm_flash_attn as vfa
from flashmonoid.flash_attn_interface import flash_attn_varlen_func, flash_attn_with_kvcache

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def make_model(layers=2, seed=0):
    """A small Llama (GQA 8/2, head dim 64) with random float32 weights; q and k projections scaled
    so that the attention is peaked, not nearly uniform (what random 0.02-std weights give)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=1024, hidden_size=512, intermediate_size=1024, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                         attn_implementation="sdpa")
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(3.0)
            layer.self_attn.k_proj.weight.mul_(3.0)
    return model


def model_as(model, dtype, device):
    """A copy of model in dtype on device; the rotary frequencies stay as model has them (a cast of
    the copy would round them to dtype)."""
    m = copy.deepcopy(model).to(device=device, dtype=dtype)
    m.model.rotary_emb.inv_freq = model.model.rotary_emb.inv_freq.to(device)
    return m


class PagedLlama:
    """Prefill and decoding of a transformers Llama with its attention on flashmonoid over a paged
    KV cache. The model's own modules do everything else (norms, projections, MLP, head)."""

    def __init__(self, model, batch, max_len, page_size=16, spare_pages=3, seed=0):
        cfg = model.config
        p = next(model.parameters())
        self.model, self.device, self.dtype = model, p.device, p.dtype
        self.h, self.h_k, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.page_size, pages_per_seq = page_size, -(-max_len // page_size)
        self.cache_seqlens = torch.zeros(batch, dtype=torch.int32, device=self.device)
        # flash-attn's rotary tables (seqlen_ro, d / 2): the first halves of the model's own cos / sin
        # (transformers computes the angles in float32 and repeats them, the rotate_half convention:
        # non-interleaved), so the tables hold the bits the model rotates with.
        positions = torch.arange(pages_per_seq * page_size, device=self.device)[None]
        cos, sin = model.model.rotary_emb(torch.zeros(1, dtype=self.dtype, device=self.device), positions)
        self.cos, self.sin = (x[0, :, :self.d // 2].contiguous() for x in (cos, sin))
        self._allocate(cfg.num_hidden_layers, batch, pages_per_seq, spare_pages, seed)

    def _allocate(self, layers, batch, pages_per_seq, spare_pages, seed):
        num_pages = batch * pages_per_seq + spare_pages
        g = torch.Generator().manual_seed(seed)
        order = torch.randperm(num_pages, generator=g)[:batch * pages_per_seq]
        self.block_table = order.view(batch, pages_per_seq).to(self.device, torch.int32)
        shape = (num_pages, self.page_size, self.h_k, self.d)
        self.k_cache, self.v_cache = ([torch.full(shape, float("nan"), dtype=self.dtype, device=self.device)
                                       for _ in range(layers)] for _ in range(2))

    def _qkv(self, attn, x):
        rows = x.shape[:-1]
        return (attn.q_proj(x).view(*rows, self.h, self.d), attn.k_proj(x).view(*rows, self.h_k, self.d),
                attn.v_proj(x).view(*rows, self.h_k, self.d))

    def _rotate(self, x, positions):
        """x (*positions.shape, heads, d) rotated by the engine (the kernel's rule: float32 math on the
        rounded inputs)."""
        half = self.d // 2
        c, s = self.cos[positions].float()[..., None, :], self.sin[positions].float()[..., None, :]
        a, b = x[..., :half].float(), x[..., half:].float()
        return torch.cat((a * c - b * s, a * s + b * c), dim=-1).to(x.dtype)

    def _write_rows(self, i, k, v, seq, pos):
        """k, v (rows, h_k, d) into layer i's pages at sequence seq's position pos (device tensors; no
        host read, so a decoding step that writes rows can be captured in a CUDA graph)."""
        row = self.block_table[seq, pos // self.page_size].long() * self.page_size + pos % self.page_size
        self.k_cache[i].view(-1, self.h_k, self.d).index_copy_(0, row, k)
        self.v_cache[i].view(-1, self.h_k, self.d).index_copy_(0, row, v)

    def _cu_seqlens(self, lens):
        """int32 (len(lens) + 1) on the device: the packed prompts' offsets."""
        return torch.tensor([0] + lens).cumsum(0, dtype=torch.int32).to(self.device)

    def _prefill_attention(self, i, q, k, v, seq, pos, lens):
        """The packed prompts' rows (rows, heads, d), q and k rotated, into layer i's cache and attended."""
        self._write_rows(i, k, v, seq, pos)
        cu = self._cu_seqlens(lens)
        return flash_attn_varlen_func(q, self.k_cache[i], self.v_cache[i], cu, cu, max(lens), max(lens),
                                      causal=True, block_table=self.block_table)

    def _step_attention(self, i, q, k, v):
        """q (batch, n, h, d) and the new k, v over layer i's cache: append, rotary and attention in one call."""
        return flash_attn_with_kvcache(q, self.k_cache[i], self.v_cache[i], k, v, rotary_cos=self.cos,
                                       rotary_sin=self.sin, cache_seqlens=self.cache_seqlens,
                                       block_table=self.block_table, causal=True, rotary_interleaved=False)

    @torch.no_grad()
    def prefill(self, prompts):
        """prompts: one 1-D token tensor per sequence. Returns each sequence's last logits (batch, vocab)."""
        m = self.model.model
        lens = [len(t) for t in prompts]
        seq = torch.repeat_interleave(torch.arange(len(prompts)), torch.tensor(lens)).to(self.device)
        pos = torch.cat([torch.arange(n) for n in lens]).to(self.device)
        x = m.embed_tokens(torch.cat(prompts).to(self.device))
        for i, layer in enumerate(m.layers):
            q, k, v = self._qkv(layer.self_attn, layer.input_layernorm(x))
            o = self._prefill_attention(i, self._rotate(q, pos), self._rotate(k, pos), v, seq, pos, lens)
            x = x + layer.self_attn.o_proj(o.reshape(len(pos), self.h * self.d))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        self.cache_seqlens.copy_(torch.tensor(lens, dtype=torch.int32))
        last = torch.tensor(lens).cumsum(0) - 1
        return self.model.lm_head(m.norm(x[last.to(self.device)])).float()

    @torch.no_grad()
    def step(self, tokens):
        """One decoding step for every sequence: tokens (batch, n) -> logits (batch, n, vocab). n > 1 is a
        speculative step verifying n - 1 draft tokens (causal among the n). Reads and advances
        cache_seqlens on the device only, so it can be captured in a CUDA graph."""
        m = self.model.model
        b, n = tokens.shape
        x = m.embed_tokens(tokens)
        for i, layer in enumerate(m.layers):
            o = self._step_attention(i, *self._qkv(layer.self_attn, layer.input_layernorm(x)))
            x = x + layer.self_attn.o_proj(o.reshape(b, n, self.h * self.d))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        self.cache_seqlens.add_(n)
        return self.model.lm_head(m.norm(x)).float()


class Fa3Packed(PagedLlama):
    """The same pages through flash-attn 3's interface as SGLang's flash-attn 3 backend calls it: the
    engine rotates q and k and writes k and v into the pages itself, then every attention, prefill
    and decoding alike, is one `flash_attn_with_kvcache` call with packed queries (cu_seqlens_q,
    max_seqlen_q) over the keys already in the cache (cache_seqlens), causal; no append in the call."""

    def _packed_attention(self, i, q, lens, cu_q, max_q):
        return fa3.flash_attn_with_kvcache(q, self.k_cache[i], self.v_cache[i], page_table=self.block_table,
                                           cache_seqlens=lens, cu_seqlens_q=cu_q, max_seqlen_q=max_q, causal=True)

    def _prefill_attention(self, i, q, k, v, seq, pos, lens):
        self._write_rows(i, k, v, seq, pos)
        lens_k = torch.tensor(lens, dtype=torch.int32, device=self.device)
        return self._packed_attention(i, q, lens_k, self._cu_seqlens(lens), max(lens))

    def _step_attention(self, i, q, k, v):
        b, n = q.shape[:2]
        if i == 0:  # the new rows' positions, the lengths with them and the packed queries' bounds, once a step
            self._pos = self.cache_seqlens.long()[:, None] + torch.arange(n, device=self.device)  # (b, n)
            self._seq = torch.arange(b, device=self.device)[:, None].expand(b, n)
            self._lens = self.cache_seqlens + n
            self._cu = torch.arange(0, b * n + 1, n, dtype=torch.int32, device=self.device)
        q, k = self._rotate(q, self._pos), self._rotate(k, self._pos)
        self._write_rows(i, k.flatten(0, 1), v.flatten(0, 1), self._seq.flatten(), self._pos.flatten())
        return self._packed_attention(i, q.flatten(0, 1), self._lens, self._cu, n).view(b, n, self.h, self.d)


class VllmPaged(Fa3Packed):
    """The same pages through vLLM's call (`flashmonoid.vllm_flash_attn.flash_attn_varlen_func`), as
    vLLM's FlashAttention backend makes every step: packed queries over the pages with seqused_k as
    the key counts and the block table, written into a preallocated output (out=); max_seqlen_k is
    the pages' capacity, a host number known without reading the device."""

    def _packed_attention(self, i, q, lens, cu_q, max_q):
        out = torch.empty_like(q)
        return vfa.flash_attn_varlen_func(q, self.k_cache[i], self.v_cache[i], max_q, cu_q,
                                          self.block_table.shape[1] * self.page_size, seqused_k=lens, causal=True,
                                          block_table=self.block_table, out=out)


class StaticCacheSdpa(PagedLlama):
    """The baseline, in the same loop: what transformers' static cache does with torch's
    scaled_dot_product_attention. Per layer a contiguous head-major cache (batch, h_k, capacity, d)
    of zeros; q and the new k rotated by torch ops, the new rows written with scatter_ at
    cache_seqlens, then attention over the whole capacity with a mask of the rows each query sees."""

    def _allocate(self, layers, batch, pages_per_seq, spare_pages, seed):
        self.block_table = None
        shape = (batch, self.h_k, pages_per_seq * self.page_size, self.d)
        self.k_cache, self.v_cache = ([torch.zeros(shape, dtype=self.dtype, device=self.device)
                                       for _ in range(layers)] for _ in range(2))

    def _prefill_attention(self, i, q, k, v, seq, pos, lens):
        self.k_cache[i][seq, :, pos] = k
        self.v_cache[i][seq, :, pos] = v
        out, start = [], 0
        for n in lens:  # one causal call per prompt (the prefill is not what is compared)
            rows = [x[start:start + n].transpose(0, 1) for x in (q, k, v)]
            out.append(torch.nn.functional.scaled_dot_product_attention(*rows, is_causal=True, enable_gqa=True)
                       .transpose(0, 1))
            start += n
        return torch.cat(out)

    def _step_attention(self, i, q, k, v):
        b, n = q.shape[:2]
        if i == 0:  # the positions and the mask, once per step as transformers makes them
            self._pos = self.cache_seqlens.long()[:, None] + torch.arange(n, device=self.device)  # (b, n)
            capacity = self.k_cache[0].shape[2]
            self._mask = (torch.arange(capacity, device=self.device) <= self._pos[..., None])[:, None]
        q, k = self._rotate(q, self._pos), self._rotate(k, self._pos)
        rows = self._pos[:, None, :, None].expand(b, self.h_k, n, self.d)
        self.k_cache[i].scatter_(2, rows, k.transpose(1, 2))
        self.v_cache[i].scatter_(2, rows, v.transpose(1, 2))
        return torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), self.k_cache[i], self.v_cache[i], attn_mask=self._mask, enable_gqa=True).transpose(1, 2)


class Drafter:
    """Self-speculative drafts: the target model's weights in a lower precision (bf16; fp16 for a
    bf16 target) propose greedy tokens through transformers' own forward (no cache). They agree with
    the target at most positions, so steps keep several tokens and still reject some."""

    def __init__(self, model32, target_dtype, device):
        self.model = model_as(model32, torch.float16 if target_dtype == torch.bfloat16 else torch.bfloat16, device)

    @torch.no_grad()
    def propose(self, history, k):
        dev = next(self.model.parameters()).device
        ids = torch.tensor(history, device=dev)[None]
        for _ in range(k):
            ids = torch.cat((ids, self.model(ids).logits[:, -1:].argmax(-1)), dim=1)
        return ids[0, len(history):].tolist()


def generate(engine, prompts, steps, graph, draft=1, drafter=None):
    """Greedy decoding: the prefill, then `steps` decoding steps of `draft` tokens each (one CUDA graph
    replayed per step when graph). draft = 1: one token per step, no host synchronisation. draft > 1:
    speculative decoding; each step feeds the next token and draft - 1 guesses (drafter), keeps the
    guesses up to the first the logits disagree with and moves cache_seqlens back over the rest.
    Returns, per sequence, the tokens fed and kept and the logits of the prefill and of those tokens
    (kept + 1, vocab), and the decoding steps' seconds (without the drafter's)."""
    first = engine.prefill(prompts)
    b, dev = len(prompts), engine.device
    static_tokens = torch.zeros(b, draft, dtype=torch.long, device=dev)
    if graph:
        state = engine.cache_seqlens.clone()  # the warm-up below advances it; its cache rows are rewritten
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            engine.step(static_tokens)
        torch.cuda.current_stream().wait_stream(side)
        engine.cache_seqlens.copy_(state)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            static_logits = engine.step(static_tokens)
    run = (lambda: (g.replay(), static_logits)[1]) if graph else (lambda: engine.step(static_tokens))
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    fed, logits = [[] for _ in range(b)], [[first[i:i + 1]] for i in range(b)]
    nxt = first.argmax(-1)
    sync()
    start = time.perf_counter()
    if draft == 1:
        columns, outs = [], []
        for _ in range(steps):
            columns.append(nxt)
            static_tokens[:, 0] = nxt
            outs.append(run()[:, 0].clone())
            nxt = outs[-1].argmax(-1)
        sync()
        seconds = time.perf_counter() - start
        fed = list(torch.stack(columns, dim=1)) if steps else [torch.zeros(0, dtype=torch.long)] * b
        for i in range(b):
            logits[i] += [out[i:i + 1] for out in outs]
    else:
        history = [p.tolist() for p in prompts]
        verifying = 0.0  # the steps' seconds, without the drafter's
        nxt = nxt.tolist()
        for _ in range(steps):
            rows = [[nxt[i]] + drafter.propose(history[i] + [nxt[i]], draft - 1) for i in range(b)]
            verifying -= time.perf_counter()
            static_tokens.copy_(torch.tensor(rows))
            out = run()
            guess = out.argmax(-1).tolist()  # the one host synchronisation per step
            verifying += time.perf_counter()
            back = []
            for i in range(b):
                kept = 1
                while kept < draft and rows[i][kept] == guess[i][kept - 1]:
                    kept += 1
                fed[i] += rows[i][:kept]
                history[i] += rows[i][:kept]
                logits[i].append(out[i, :kept].clone())
                nxt[i] = guess[i][kept - 1]
                back.append(draft - kept)
            engine.cache_seqlens.sub_(torch.tensor(back, dtype=torch.int32, device=dev))
        fed, seconds = [torch.tensor(f, dtype=torch.long) for f in fed], verifying
    return fed, [torch.cat(rows) for rows in logits], seconds


@torch.no_grad()
def reference_logits(model, prompts, fed):
    """The model's own forward over prompt + fed tokens, one sequence at a time: per sequence, the
    logits at the prompt's last position and at each fed token (fed + 1, vocab), float64."""
    dev = next(model.parameters()).device
    return [model(torch.cat((p.to(dev), f.to(dev)))[None]).logits[0, len(p) - 1:].double()
            for p, f in zip(prompts, fed)]


def max_error(logits, ref):
    return max((x.double() - r).abs().max().item() for x, r in zip(logits, ref))


ENGINES = {"flashmonoid": PagedLlama, "fa3_packed": Fa3Packed, "vllm": VllmPaged, "sdpa": StaticCacheSdpa}


def run(device="cpu", dtype=torch.float32, layers=2, batch=4, steps=24, page_size=16, graph=None, draft=1, seed=0,
        prompt_lens=None, context=0, engine="flashmonoid"):
    """Generates with ENGINES[engine] and checks; returns a dict of errors, times and tokens. Prompt
    lengths: prompt_lens, else random in [context / 2, context] when context, else a few that cross
    pages."""
    device = torch.device(device)
    graph = device.type == "cuda" if graph is None else graph
    model32 = make_model(layers, seed)
    model = model_as(model32, dtype, device)
    g = torch.Generator().manual_seed(seed + 1)
    if prompt_lens is None and context:
        prompt_lens = [int(x) for x in torch.randint(max(1, context // 2), context + 1, (batch,), generator=g)]
    elif prompt_lens is None:  # lengths that cross pages, one of a single token
        prompt_lens = [1, max(1, page_size - 1), page_size + 2, 2 * page_size + 5][:batch]
        prompt_lens += [int(x) for x in torch.randint(1, 3 * page_size, (batch - len(prompt_lens),), generator=g)]
    prompts = [torch.randint(0, model32.config.vocab_size, (n,), generator=g) for n in prompt_lens]
    name = engine
    engine = ENGINES[name](model, batch, max(prompt_lens) + steps * draft + 1, page_size=page_size, seed=seed)
    drafter = Drafter(model32, dtype, device) if draft > 1 else None
    fed, logits, seconds = generate(engine, prompts, steps, graph, draft, drafter)

    ref = reference_logits(model_as(model32, torch.float64, device), prompts, fed)
    err, err_same_math = max_error(logits, ref), max_error(reference_logits(model, prompts, fed), ref)
    # float32: both errors are rounding noise (~2e-6 of the logits' size); a floor of 1e-6 of it.
    floor = 1e-6 * max(r.abs().max().item() for r in ref) if dtype == torch.float32 else 0.0
    lengths = [n + len(f) for n, f in zip(prompt_lens, fed)]
    agree = torch.cat([(x.argmax(-1) == r.argmax(-1)).float() for x, r in zip(logits, ref)]).mean().item()
    paged = engine.block_table is not None
    return {"engine": name, "device": str(device), "dtype": str(dtype).replace("torch.", ""), "graph": graph,
            "batch": batch,
            "steps": steps, "draft": draft, "page_size": page_size, "prompt_lens": prompt_lens, "err": err,
            "err_same_math": err_same_math, "bound": 2 * err_same_math + floor,
            "finite": all(bool(torch.isfinite(x).all()) for x in logits),
            "lengths_ok": engine.cache_seqlens.cpu().tolist() == lengths,
            "cache_ok": cache_holds_exactly(engine, lengths, draft - 1) if paged else None,
            "tokens_per_step": sum(len(f) for f in fed) / (batch * steps) if steps else 0.0,
            "greedy_agree_f64": agree, "ms_per_step": 1e3 * seconds / steps if steps else 0.0}


def cache_holds_exactly(engine, lengths, overhang=0):
    """Whether every layer's pages hold whole finite rows at each sequence's positions < length
    (through the block table), the NaN poison at every row past length + overhang (a speculative
    step's rejected rows stay written past the length) and in the spare pages: no append went to a
    wrong row or page."""
    shape = engine.k_cache[0].shape[:2]
    need, may = torch.zeros(shape, dtype=torch.bool), torch.zeros(shape, dtype=torch.bool)
    table = engine.block_table.cpu().long()
    for i, n in enumerate(lengths):
        for mask, rows in ((need, n), (may, min(n + overhang, table.shape[1] * engine.page_size))):
            pos = torch.arange(rows)
            mask[table[i, pos // engine.page_size], pos % engine.page_size] = True
    for cache in engine.k_cache + engine.v_cache:
        finite = torch.isfinite(cache.cpu().float())
        whole, some = finite.all(-1).all(-1), finite.any(-1).any(-1)
        if not torch.equal(whole, some) or bool((need & ~whole).any()) or bool((whole & ~may).any()):
            return False
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=DTYPES, default=None, help="default: bf16 on cuda, fp32 on cpu")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--context", type=int, default=0, help="prompt lengths in [context / 2, context]")
    ap.add_argument("--draft", type=int, default=1, help="tokens per step: > 1 is speculative decoding (Drafter)")
    ap.add_argument("--no-graph", action="store_true", help="on cuda: launch every step eagerly")
    ap.add_argument("--engine", choices=[*ENGINES, "both", "all"], default="flashmonoid",
                    help="fa3_packed: the pages through flash-attn 3's packed-query call (SGLang's backend); vllm: "
                         "through vLLM's flash_attn_varlen_func (its FlashAttention backend); sdpa: "
                         "transformers' static cache with torch's SDPA, the baseline; both: flashmonoid then sdpa; "
                         "all: every engine")
    a = ap.parse_args()
    dtype = DTYPES[a.dtype or ("bf16" if a.device.startswith("cuda") else "fp32")]
    ok = True
    engines = {"both": ["flashmonoid", "sdpa"], "all": list(ENGINES)}.get(a.engine, [a.engine])
    for engine in engines:
        r = run(a.device, dtype, a.layers, a.batch, a.steps, a.page_size, graph=False if a.no_graph else None,
                draft=a.draft, context=a.context, engine=engine)
        good = r["finite"] and r["lengths_ok"] and r["cache_ok"] is not False and r["err"] <= r["bound"]
        ok = ok and good
        lens = r["prompt_lens"]
        print(f"{engine}: {r['device']} {r['dtype']}, batch {r['batch']} (prompts of {min(lens)}-{max(lens)} tokens), "
              f"pages of {r['page_size']}, {r['steps']} steps of {r['draft']} token(s)"
              f"{', each one CUDA graph' if r['graph'] else ''}: {r['ms_per_step']:.3f} ms and "
              f"{r['tokens_per_step']:.2f} tokens kept per step and sequence")
        print(f"  logits vs the model in float64: max error {r['err']:.3g}; the model in {r['dtype']}: "
              f"{r['err_same_math']:.3g}; greedy tokens equal to float64's at {100 * r['greedy_agree_f64']:.1f}% "
              f"of positions; the cache holds exactly the sequences' rows: {r['cache_ok']} -> "
              f"{'OK' if good else 'FAIL'}")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
