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
  in place after the last layer). On a GPU the whole step (embedding, layers, logits, argmax) is
  captured once in a CUDA graph and replayed for every token: no host synchronisation between
  tokens.
- Check: the model's own forward (transformers, its SDPA attention, no cache) over the generated
  sequences gives the logits every step should have produced; the loop's error against the model in
  float64 must be at most twice that of the model run in the loop's dtype (the FlashAttention rule,
  applied to the logits). Afterwards the pages must hold finite rows exactly at the sequences'
  positions and the poison everywhere else.

    python examples/serving_loop.py                  # CUDA (bf16, CUDA graph) if present, else CPU (fp32)
    python examples/serving_loop.py --device cpu --dtype bf16 --steps 40

Needs torch, transformers and flashmonoid. tests/python/test_serving_loop.py runs `run()` small.
"""

import argparse
import copy
import time

import torch

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
        pages_per_seq = -(-max_len // page_size)
        num_pages = batch * pages_per_seq + spare_pages
        g = torch.Generator().manual_seed(seed)
        order = torch.randperm(num_pages, generator=g)[:batch * pages_per_seq]
        self.page_size = page_size
        self.block_table = order.view(batch, pages_per_seq).to(self.device, torch.int32)
        shape = (num_pages, page_size, self.h_k, self.d)
        self.k_cache = [torch.full(shape, float("nan"), dtype=self.dtype, device=self.device) for _ in range(cfg.num_hidden_layers)]
        self.v_cache = [torch.full(shape, float("nan"), dtype=self.dtype, device=self.device) for _ in range(cfg.num_hidden_layers)]
        self.cache_seqlens = torch.zeros(batch, dtype=torch.int32, device=self.device)
        # flash-attn's rotary tables (seqlen_ro, d / 2): the model's frequencies, in float64, then dtype.
        # Non-interleaved halves: transformers' rotate_half convention.
        inv_freq = model.model.rotary_emb.inv_freq.double().to(self.device)
        angles = torch.arange(pages_per_seq * page_size, device=self.device, dtype=torch.float64)[:, None] * inv_freq
        scaling = getattr(model.model.rotary_emb, "attention_scaling", 1.0)
        self.cos = (angles.cos() * scaling).to(self.dtype)
        self.sin = (angles.sin() * scaling).to(self.dtype)

    def _qkv(self, attn, x, rows):
        return (attn.q_proj(x).view(rows, self.h, self.d), attn.k_proj(x).view(rows, self.h_k, self.d),
                attn.v_proj(x).view(rows, self.h_k, self.d))

    def _rotate(self, x, positions):
        """The engine's rotary for prefill (the kernel's rule: float32 math on the rounded inputs)."""
        half = self.d // 2
        c, s = self.cos[positions].float()[:, None], self.sin[positions].float()[:, None]
        a, b = x[..., :half].float(), x[..., half:].float()
        return torch.cat((a * c - b * s, a * s + b * c), dim=-1).to(x.dtype)

    @torch.no_grad()
    def prefill(self, prompts):
        """prompts: one 1-D token tensor per sequence. Returns each sequence's last logits (batch, vocab)."""
        m = self.model.model
        lens = torch.tensor([len(t) for t in prompts])
        cu = torch.zeros(len(prompts) + 1, dtype=torch.int32)
        cu[1:] = lens.cumsum(0)
        cu = cu.to(self.device)
        seq = torch.repeat_interleave(torch.arange(len(prompts)), lens).to(self.device)
        pos = torch.cat([torch.arange(n) for n in lens.tolist()]).to(self.device)
        page = self.block_table[seq, pos // self.page_size].long()
        slot = pos % self.page_size
        rows, max_len = int(lens.sum()), int(lens.max())
        x = m.embed_tokens(torch.cat(prompts).to(self.device))
        for i, layer in enumerate(m.layers):
            q, k, v = self._qkv(layer.self_attn, layer.input_layernorm(x), rows)
            q, k = self._rotate(q, pos), self._rotate(k, pos)
            self.k_cache[i][page, slot] = k
            self.v_cache[i][page, slot] = v
            o = flash_attn_varlen_func(q, self.k_cache[i], self.v_cache[i], cu, cu, max_len, max_len, causal=True,
                                       block_table=self.block_table)
            x = x + layer.self_attn.o_proj(o.reshape(rows, self.h * self.d))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        self.cache_seqlens.copy_(lens.to(self.cache_seqlens.dtype))
        return self.model.lm_head(m.norm(x[cu[1:].long() - 1])).float()

    @torch.no_grad()
    def step(self, tokens):
        """One decoding step for every sequence: tokens (batch,) -> logits (batch, vocab). Reads and
        advances cache_seqlens on the device only, so it can be captured in a CUDA graph."""
        m = self.model.model
        b = tokens.shape[0]
        x = m.embed_tokens(tokens)
        for i, layer in enumerate(m.layers):
            q, k, v = self._qkv(layer.self_attn, layer.input_layernorm(x), b)
            o = flash_attn_with_kvcache(q[:, None], self.k_cache[i], self.v_cache[i], k[:, None], v[:, None],
                                        rotary_cos=self.cos, rotary_sin=self.sin, cache_seqlens=self.cache_seqlens,
                                        block_table=self.block_table, causal=True, rotary_interleaved=False)
            x = x + layer.self_attn.o_proj(o.reshape(b, self.h * self.d))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        self.cache_seqlens.add_(1)
        return self.model.lm_head(m.norm(x)).float()


def generate(engine, prompts, steps, graph):
    """Greedy decoding: the prefill, then `steps` decoding steps (one CUDA graph replayed each step when
    graph). Returns the tokens fed to the decoding steps (batch, steps), the logits of the prefill and of
    every step (batch, steps + 1, vocab), and the decoding steps' seconds."""
    logits = [engine.prefill(prompts)]
    tokens = logits[0].argmax(-1)
    fed = torch.empty(len(prompts), steps, dtype=torch.long, device=engine.device)
    if graph:
        static_tokens = tokens.clone()
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
            static_next = static_logits.argmax(-1)
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for t in range(steps):
        fed[:, t] = tokens
        if graph:
            static_tokens.copy_(tokens)
            g.replay()
            logits.append(static_logits.clone())
            tokens = static_next.clone()
        else:
            logits.append(engine.step(tokens))
            tokens = logits[-1].argmax(-1)
    sync()
    return fed, torch.stack(logits, dim=1), time.perf_counter() - start


@torch.no_grad()
def reference_logits(model, prompts, fed):
    """The model's own forward over prompt + fed tokens, one sequence at a time: the logits at the
    prompt's last position and at each fed token (batch, steps + 1, vocab), float64."""
    out = []
    for i, prompt in enumerate(prompts):
        ids = torch.cat((prompt.to(fed.device), fed[i]))[None]
        out.append(model(ids).logits[0, len(prompt) - 1:].double())
    return torch.stack(out)


def run(device="cpu", dtype=torch.float32, layers=2, batch=4, steps=24, page_size=16, graph=None, seed=0,
        prompt_lens=None):
    """Generates and checks; returns a dict of errors, times and tokens."""
    device = torch.device(device)
    graph = device.type == "cuda" if graph is None else graph
    model32 = make_model(layers, seed)
    model = model_as(model32, dtype, device)
    g = torch.Generator().manual_seed(seed + 1)
    if prompt_lens is None:  # lengths that cross pages, one of a single token
        prompt_lens = [1, max(1, page_size - 1), page_size + 2, 2 * page_size + 5][:batch]
        prompt_lens += [int(x) for x in torch.randint(1, 3 * page_size, (batch - len(prompt_lens),), generator=g)]
    prompts = [torch.randint(0, model32.config.vocab_size, (n,), generator=g) for n in prompt_lens]
    engine = PagedLlama(model, batch, max(prompt_lens) + steps + 1, page_size=page_size, seed=seed)
    fed, logits, seconds = generate(engine, prompts, steps, graph)

    ref = reference_logits(model_as(model32, torch.float64, device), prompts, fed)
    same_math = reference_logits(model, prompts, fed)
    err = (logits.double() - ref).abs().max().item()
    err_same_math = (same_math - ref).abs().max().item()
    # float32: both errors are rounding noise (~2e-6 of the logits' size); a floor of 1e-6 of it.
    floor = 1e-6 * ref.abs().max().item() if dtype == torch.float32 else 0.0
    lengths = torch.tensor(prompt_lens) + steps
    return {"device": str(device), "dtype": str(dtype).replace("torch.", ""), "graph": graph, "batch": batch,
            "steps": steps, "page_size": page_size, "prompt_lens": prompt_lens, "err": err,
            "err_same_math": err_same_math, "bound": 2 * err_same_math + floor,
            "finite": bool(torch.isfinite(logits).all()),
            "lengths_ok": engine.cache_seqlens.cpu().tolist() == lengths.tolist(),
            "cache_ok": cache_holds_exactly(engine, lengths),
            "greedy_agree_f64": (logits.argmax(-1) == ref.argmax(-1)).float().mean().item(),
            "ms_per_step": 1e3 * seconds / steps}


def cache_holds_exactly(engine, lengths):
    """Whether every layer's pages hold finite rows exactly at the sequences' positions < length
    (through the block table) and the NaN poison everywhere else: no append went to a wrong row
    or page, no spare page was touched."""
    written = torch.zeros(engine.k_cache[0].shape[:2], dtype=torch.bool)
    table = engine.block_table.cpu().long()
    for i, n in enumerate(lengths.tolist()):
        pos = torch.arange(n)
        written[table[i, pos // engine.page_size], pos % engine.page_size] = True
    for cache in engine.k_cache + engine.v_cache:
        finite = torch.isfinite(cache.cpu().float())
        if not torch.equal(finite.all(-1).all(-1), written) or not torch.equal(finite.any(-1).any(-1), written):
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
    ap.add_argument("--no-graph", action="store_true", help="on cuda: launch every step eagerly")
    a = ap.parse_args()
    dtype = DTYPES[a.dtype or ("bf16" if a.device.startswith("cuda") else "fp32")]
    r = run(a.device, dtype, a.layers, a.batch, a.steps, a.page_size,
            graph=False if a.no_graph else None)
    ok = r["finite"] and r["lengths_ok"] and r["cache_ok"] and r["err"] <= r["bound"]
    print(f"{r['device']} {r['dtype']}, batch {r['batch']} (prompts {r['prompt_lens']}), pages of {r['page_size']}, "
          f"{r['steps']} steps{' in one CUDA graph' if r['graph'] else ''}: {r['ms_per_step']:.3f} ms per step")
    print(f"logits vs the model in float64: max error {r['err']:.3g}; the model in {r['dtype']}: "
          f"{r['err_same_math']:.3g}; greedy tokens equal to float64's at {100 * r['greedy_agree_f64']:.1f}% "
          f"of positions; the cache holds exactly the sequences' rows: {r['cache_ok']} -> {'OK' if ok else 'FAIL'}")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
