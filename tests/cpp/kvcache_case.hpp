// One randomized forward_kvcache problem on the host, and its expected result built independently
// of the cache addressing: each sequence's keys gathered into a packed varlen problem (the rows it
// holds from leftpad on, then the appended rows), q rotated, and the plain varlen reference run on
// that. Cache rows and pages that no sequence uses hold NaN, so reading one shows up in the output.
#pragma once

#include <algorithm>
#include <cstring>
#include <numeric>
#include <string>

#include "attention_case.hpp"
#include "flashmonoid/detail/rotary.hpp"

namespace fmtest {

struct KvShape {
  int b = 2, s_q = 1, s_new = 1, h = 4, h_k = 2, d = 64;
  DType dtype = DType::f32;
  int page_size = 0;   // 0 = contiguous cache
  int capacity = 64;   // rows per sequence (paged: rounded up to whole pages)
  bool batch_idx = false, leftpad = false;
  bool seqlens_tensor = true;  // false: one host int (every sequence holds the same rows)
  bool full = false;           // every sequence full after the append
  int held = -1;               // >= 0: the rows every sequence holds before the append (else random)
  int rotary_dim = 0;
  bool interleaved = true;
  bool causal = false;
  int window_left = -1, window_right = -1;
  float softcap = 0.0f;
  bool alibi = false;
  int threads = 0;  // Context::num_threads (0: OpenMP's default)
  bool head_major = false;     // cache memory (entries or pages, h_k, rows, d): HF transformers' layout

  std::string str() const {
    std::string s = "b" + std::to_string(b) + " sq" + std::to_string(s_q) + " new" + std::to_string(s_new) + " h" +
                    std::to_string(h) + "/" + std::to_string(h_k) + " d" + std::to_string(d) + " " +
                    flashmonoid::to_string(dtype) + " cap" + std::to_string(capacity);
    s += page_size ? " page" + std::to_string(page_size) : " contiguous";
    if (batch_idx) s += " batch_idx";
    if (leftpad) s += " leftpad";
    if (!seqlens_tensor) s += " seqlen-int";
    if (held >= 0) s += " held" + std::to_string(held);
    if (rotary_dim) s += " rotary" + std::to_string(rotary_dim) + (interleaved ? "i" : "n");
    if (causal) s += " causal";
    if (window_left >= 0 || window_right >= 0)
      s += " window(" + std::to_string(window_left) + "," + std::to_string(window_right) + ")";
    if (softcap > 0) s += " softcap";
    if (alibi) s += " alibi";
    if (threads) s += " threads" + std::to_string(threads);
    if (head_major) s += " head-major";
    return s;
  }
};

inline int uniform_int(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng()); }

// x (a row of d features in a HostTensor at logical index base) rotated at position pos.
inline void rotate_host_row(HostTensor& x, std::int64_t base, int d, const HostTensor& cos, const HostTensor& sin,
                            int rotary_dim, bool interleaved, std::int64_t pos) {
  const int half = rotary_dim / 2;
  std::vector<float> r(d);
  for (int c = 0; c < d; ++c) r[c] = x.get(base + c);
  for (int i = 0; i < half; ++i) {
    const auto pr = flashmonoid::detail::rotary_pair(i, rotary_dim, interleaved);
    flashmonoid::detail::rotate(r[pr.a], r[pr.b], cos.get(pos * half + i), sin.get(pos * half + i), &r[pr.a], &r[pr.b]);
  }
  for (int c = 0; c < d; ++c) x.set(base + c, r[c]);
}

struct KvProblem {
  KvShape s;
  int capacity = 0, max_pages = 0, num_pages = 0, b_cache = 0;
  std::vector<int> held, lp, entry, table;
  HostTensor q, k_new, v_new, k_cache, v_cache, block_table, batch_idx, seqlens, leftpad, cos, sin, alibi;
  flashmonoid::Options opt;

  explicit KvProblem(const KvShape& shape) : s(shape) {
    const bool paged = s.page_size > 0;
    max_pages = paged ? (s.capacity + s.page_size - 1) / s.page_size : 0;
    capacity = paged ? max_pages * s.page_size : s.capacity;
    // Sequences' lengths: a shared one for a host int, else random, appended rows always fit.
    held.resize(s.b);
    lp.assign(s.b, 0);
    const int common = uniform_int(0, capacity - s.s_new);
    for (int i = 0; i < s.b; ++i) {
      held[i] = s.held >= 0 ? s.held
                : s.full    ? capacity - s.s_new
                : s.seqlens_tensor ? uniform_int(0, capacity - s.s_new) : common;
      if (s.leftpad) lp[i] = uniform_int(0, held[i]);
    }
    const std::int64_t rows_phys = paged ? s.page_size : capacity;
    // (entries or pages, rows, h_k, d) views, of head-major memory with head_major.
    const auto cache_tensor = [&](std::int64_t n) {
      if (!s.head_major) return HostTensor(s.dtype, {n, rows_phys, s.h_k, s.d});
      const std::int64_t head = rows_phys * s.d;
      return HostTensor(s.dtype, {n, rows_phys, s.h_k, s.d}, {s.h_k * head, s.d, head, 1});
    };
    if (paged) {
      num_pages = s.b * max_pages + 3;  // spare pages stay NaN
      std::vector<int> perm(num_pages);
      std::iota(perm.begin(), perm.end(), 0);
      std::shuffle(perm.begin(), perm.end(), rng());
      block_table = HostTensor(DType::i32, {s.b, max_pages});
      table.resize(static_cast<std::size_t>(s.b) * max_pages);
      for (int i = 0; i < s.b * max_pages; ++i) table[i] = perm[i];
      for (int i = 0; i < s.b; ++i)  // entries past a sequence's used pages are never read: garbage
        for (int pg = (held[i] + s.s_new + s.page_size - 1) / s.page_size; pg < max_pages; ++pg)
          table[i * max_pages + pg] = 1 << 30;
      std::memcpy(block_table.view.data, table.data(), table.size() * sizeof(int));
      k_cache = cache_tensor(num_pages);
    } else {
      b_cache = s.b + (s.batch_idx ? 2 : 0);
      entry.resize(b_cache);
      std::iota(entry.begin(), entry.end(), 0);
      if (s.batch_idx) {
        std::shuffle(entry.begin(), entry.end(), rng());
        batch_idx = HostTensor(DType::i32, {s.b});
        std::memcpy(batch_idx.view.data, entry.data(), s.b * sizeof(int));
      }
      k_cache = cache_tensor(b_cache);
    }
    v_cache = cache_tensor(k_cache.view.shape[0]);
    k_cache.poison();
    v_cache.poison();
    std::normal_distribution<float> n(0.0f, 1.0f);
    for (int i = 0; i < s.b; ++i)
      for (int r = lp[i]; r < held[i]; ++r)
        for (int hk = 0; hk < s.h_k; ++hk)
          for (int c = 0; c < s.d; ++c) {
            k_cache.set(cache_index(i, r, hk) + c, n(rng()));
            v_cache.set(cache_index(i, r, hk) + c, n(rng()));
          }
    seqlens = HostTensor(DType::i32, {s.b});
    std::memcpy(seqlens.view.data, held.data(), s.b * sizeof(int));
    if (s.leftpad) {
      leftpad = HostTensor(DType::i32, {s.b});
      std::memcpy(leftpad.view.data, lp.data(), s.b * sizeof(int));
    }
    // Padded rows: strided q and new k/v.
    q = HostTensor(s.dtype, {s.b, s.s_q, s.h, s.d},
                   {static_cast<std::int64_t>(s.s_q) * (s.h * s.d + 8), s.h * s.d + 8, s.d, 1});
    q.fill_normal();
    if (s.s_new > 0) {
      k_new = HostTensor(s.dtype, {s.b, s.s_new, s.h_k, s.d});
      v_new = HostTensor(s.dtype, {s.b, s.s_new, s.h_k, s.d});
      k_new.fill_normal();
      v_new.fill_normal();
    }
    if (s.rotary_dim > 0) {
      cos = HostTensor(s.dtype, {capacity, s.rotary_dim / 2});
      sin = HostTensor(s.dtype, {capacity, s.rotary_dim / 2});
      std::uniform_real_distribution<double> angle(0.0, 6.283185307179586);
      for (std::int64_t i = 0; i < cos.numel(); ++i) {
        const double a = angle(rng());
        cos.set(i, static_cast<float>(std::cos(a)));
        sin.set(i, static_cast<float>(std::sin(a)));
      }
    }
    opt.causal = s.causal;
    opt.window_left = s.window_left;
    opt.window_right = s.window_right;
    opt.softcap = s.softcap;
    if (s.alibi) {
      alibi = HostTensor(DType::f32, {s.b, s.h});
      std::uniform_real_distribution<float> u(0.0f, 0.5f);
      for (std::int64_t i = 0; i < alibi.numel(); ++i) alibi.set(i, u(rng()));
      opt.alibi_slopes = alibi.view;
    }
  }

  // Logical index of (sequence i, cache row r, KV head hk, feature 0) in k_cache / v_cache.
  std::int64_t cache_index(int i, std::int64_t r, int hk) const {
    std::int64_t slot, row;
    if (s.page_size > 0) {
      slot = table[static_cast<std::size_t>(i) * max_pages + r / s.page_size];
      row = r % s.page_size;
    } else {
      slot = entry[i];
      row = r;
    }
    return ((slot * k_cache.view.shape[1] + row) * s.h_k + hk) * s.d;
  }

  flashmonoid::KVCache cache(const HostTensor& k, const HostTensor& v) const {
    flashmonoid::KVCache c;
    c.k = k.view;
    c.v = v.view;
    if (s.page_size > 0) c.block_table = block_table.view;
    if (s.batch_idx) c.batch_idx = batch_idx.view;
    if (s.seqlens_tensor)
      c.seqlens = seqlens.view;
    else
      c.seqlen = held[0];
    if (s.leftpad) c.leftpad = leftpad.view;
    return c;
  }
  flashmonoid::Rotary rotary() const {
    flashmonoid::Rotary r;
    r.cos = cos.view;
    r.sin = sin.view;
    r.interleaved = s.interleaved;
    return r;
  }
  bool rotary_per_row() const { return s.causal || s.window_left >= 0 || s.window_right >= 0; }

  // The cache as it must be after the call: new rows written (k rotated), every other byte as before.
  std::pair<HostTensor, HostTensor> expected_cache() const {
    HostTensor k = k_cache, v = v_cache;
    k.view.data = k.buf.data();
    v.view.data = v.buf.data();
    for (int i = 0; i < s.b; ++i)
      for (int t = 0; t < s.s_new; ++t)
        for (int hk = 0; hk < s.h_k; ++hk) {
          const std::int64_t dst = cache_index(i, held[i] + t, hk);
          const std::int64_t src = ((static_cast<std::int64_t>(i) * s.s_new + t) * s.h_k + hk) * s.d;
          for (int c = 0; c < s.d; ++c) {
            k.set(dst + c, k_new.get(src + c));
            v.set(dst + c, v_new.get(src + c));
          }
          if (s.rotary_dim > 0) rotate_host_row(k, dst, s.d, cos, sin, s.rotary_dim, s.interleaved, held[i] + t);
        }
    return {std::move(k), std::move(v)};
  }

  // The same attention as a packed varlen problem over each sequence's keys [leftpad, held + s_new).
  struct Expected {
    std::vector<double> out, lse;  // out (b, s_q, h, d); lse (b, h, s_q)
  };
  // fp32_out: q, k, v copied exactly into fp32 first, so that the float64 oracle's output is not
  // rounded to a 16-bit dtype.
  Expected expected(flashmonoid::cpu::Precision prec, bool fp32_out = false) const {
    auto [kc, vc] = expected_cache();
    std::vector<int> cu_k(s.b + 1, 0);
    for (int i = 0; i < s.b; ++i) cu_k[i + 1] = cu_k[i] + held[i] + s.s_new - lp[i];
    const std::int64_t total_q = static_cast<std::int64_t>(s.b) * s.s_q, total_k = std::max(cu_k[s.b], 1);
    HostTensor qp(s.dtype, {total_q, s.h, s.d}), kp(s.dtype, {total_k, s.h_k, s.d}), vp(s.dtype, {total_k, s.h_k, s.d});
    for (std::int64_t i = 0; i < qp.numel(); ++i) qp.set(i, q.get(i));
    if (s.rotary_dim > 0)
      for (int i = 0; i < s.b; ++i)
        for (int r = 0; r < s.s_q; ++r)
          for (int hq = 0; hq < s.h; ++hq)
            rotate_host_row(qp, ((static_cast<std::int64_t>(i) * s.s_q + r) * s.h + hq) * s.d, s.d, cos, sin,
                            s.rotary_dim, s.interleaved,
                            flashmonoid::detail::rotary_query_position(held[i], r, rotary_per_row(), capacity));
    for (int i = 0; i < s.b; ++i)
      for (int j = 0; j < cu_k[i + 1] - cu_k[i]; ++j)
        for (int hk = 0; hk < s.h_k; ++hk)
          for (int c = 0; c < s.d; ++c) {
            const std::int64_t dst = ((static_cast<std::int64_t>(cu_k[i]) + j) * s.h_k + hk) * s.d + c;
            kp.set(dst, kc.get(cache_index(i, lp[i] + j, hk) + c));
            vp.set(dst, vc.get(cache_index(i, lp[i] + j, hk) + c));
          }
    HostTensor cq(DType::i32, {s.b + 1}), ck(DType::i32, {s.b + 1});
    for (int i = 0; i <= s.b; ++i) {
      cq.view.ptr<int>()[i] = i * s.s_q;
      ck.view.ptr<int>()[i] = cu_k[i];
    }
    flashmonoid::Varlen vl{cq.view, ck.view, s.s_q, capacity};
    if (fp32_out)
      for (HostTensor* t : {&qp, &kp, &vp}) {
        HostTensor f(DType::f32, std::vector<std::int64_t>(t->view.shape, t->view.shape + t->view.ndim));
        for (std::int64_t i = 0; i < t->numel(); ++i) f.set(i, t->get(i));
        *t = std::move(f);
      }
    HostTensor o(qp.view.dtype, {total_q, s.h, s.d}), l(DType::f32, {s.h, total_q});
    o.poison();
    l.poison();
    auto p = flashmonoid::detail::make_fwd_params(qp.view, kp.view, vp.view, o.view, l.view, opt, &vl);
    flashmonoid::cpu::reference_forward(p, prec);
    Expected e{o.values(), std::vector<double>(static_cast<std::size_t>(total_q) * s.h)};
    for (int i = 0; i < s.b; ++i)  // (h, total_q) -> (b, h, s_q)
      for (int hq = 0; hq < s.h; ++hq)
        for (int r = 0; r < s.s_q; ++r)
          e.lse[(static_cast<std::size_t>(i) * s.h + hq) * s.s_q + r] = l.get(static_cast<std::int64_t>(hq) * total_q + i * s.s_q + r);
    return e;
  }

  HostTensor new_out() const {
    HostTensor o(s.dtype, {s.b, s.s_q, s.h, s.d});
    o.poison();
    return o;
  }
  HostTensor new_lse() const {
    HostTensor l(DType::f32, {s.b, s.h, s.s_q});
    l.poison();
    return l;
  }
};

inline bool same_bytes(const HostTensor& a, const HostTensor& b) {
  return a.buf.size() == b.buf.size() && std::memcmp(a.buf.data(), b.buf.data(), a.buf.size()) == 0;
}

}  // namespace fmtest
