// forward_kvcache and paged varlen on the CPU: the float64 reference through the cache equals the
// reference on the gathered keys bit for bit (addressing, append, rotary positions, masks), the
// flash path meets the FlashAttention error rule, the cache holds exactly the appended rows
// afterwards, and every host-visible rule has a clear error.

#include "kvcache_case.hpp"

namespace fmtest {
namespace {

using flashmonoid::Context;
using flashmonoid::CpuAlgorithm;
using flashmonoid::cpu::Precision;

void run_case(const KvShape& shape) {
  SCOPED_TRACE(shape.str());
  KvProblem pb(shape);
  const auto [k_want, v_want] = pb.expected_cache();
  const auto want = pb.expected(Precision::f64);
  const auto lowp = pb.expected(Precision::input);
  for (CpuAlgorithm algo : {CpuAlgorithm::reference, CpuAlgorithm::flash}) {
    const bool ref = algo == CpuAlgorithm::reference;
    SCOPED_TRACE(ref ? "reference" : "flash");
    HostTensor kc = pb.k_cache, vc = pb.v_cache;  // each run appends into its own copy
    kc.view.data = kc.buf.data();
    vc.view.data = vc.buf.data();
    HostTensor out = pb.new_out(), lse = pb.new_lse();
    Context ctx;
    ctx.cpu_algorithm = algo;
    ctx.num_threads = shape.threads;
    flashmonoid::forward_kvcache(pb.q.view, pb.cache(kc, vc), pb.k_new.view, pb.v_new.view, pb.rotary(), out.view,
                                 lse.view, pb.opt, ctx);
    EXPECT_TRUE(same_bytes(kc, k_want)) << "k_cache differs from the expected append";
    EXPECT_TRUE(same_bytes(vc, v_want)) << "v_cache differs from the expected append";
    if (ref) {  // the same float64 fold over the same keys in the same order
      EXPECT_EQ(max_abs_diff(out.values(), want.out), 0.0);
      EXPECT_EQ(max_abs_diff(lse.values(), want.lse), 0.0);
    } else {
      expect_close("out", shape.dtype, out.values(), want.out, lowp.out);
      EXPECT_LE(max_abs_diff(lse.values(), want.lse), 1e-4 * std::max(1.0, max_abs(want.lse)));
    }
  }
}

KvShape base(int d, DType t) {
  KvShape s;
  s.d = d;
  s.dtype = t;
  return s;
}

TEST(KvCache, ContiguousAndPagedLayouts) {
  for (int page : {0, 1, 3, 16, 64, 256}) {
    KvShape s = base(64, DType::f32);
    s.page_size = page;
    s.capacity = page >= 64 ? 300 : 70;
    s.b = 3;
    s.s_new = 5;  // crosses page boundaries for the small pages
    s.causal = true;
    s.s_q = 5;
    run_case(s);
  }
}

TEST(KvCache, BatchIndexLeftpadAndHostSeqlen) {
  KvShape s = base(64, DType::bf16);
  s.b = 4;
  s.batch_idx = true;
  s.leftpad = true;
  s.s_q = 3;
  s.s_new = 2;
  s.causal = true;
  run_case(s);
  s.batch_idx = false;
  s.page_size = 16;
  run_case(s);
  s.seqlens_tensor = false;
  s.leftpad = false;
  run_case(s);
  s.s_new = 0;  // attention over the cache alone
  s.seqlens_tensor = true;
  s.leftpad = true;
  run_case(s);
}

TEST(KvCache, RotaryBothStyles) {
  for (bool interleaved : {true, false})
    for (bool causal : {true, false})
      for (int page : {0, 3}) {
        KvShape s = base(64, DType::f16);
        s.rotary_dim = 32;  // < d: the rest passes through
        s.interleaved = interleaved;
        s.causal = causal;
        s.s_q = 4;
        s.s_new = 4;
        s.page_size = page;
        s.leftpad = page == 0;
        run_case(s);
      }
  KvShape s = base(128, DType::bf16);  // windowed: per-row positions without causal
  s.rotary_dim = 128;
  s.interleaved = false;
  s.window_left = 20;
  s.window_right = 2;
  s.s_q = 6;
  s.s_new = 6;
  s.page_size = 16;
  s.capacity = 100;
  run_case(s);
}

TEST(KvCache, QueryLengthsMasksAndScoreMods) {
  const int lens[] = {1, 2, 7, 16, 17};
  for (int i = 0; i < 5; ++i) {
    KvShape s = base(64, i % 2 ? DType::bf16 : DType::f32);
    s.s_q = lens[i];
    s.s_new = lens[i] % 5;
    s.capacity = 90;
    s.page_size = i % 2 ? 16 : 0;
    s.causal = i % 3 != 1;
    if (i == 1) s.window_left = 9;
    if (i == 3) {
      s.window_left = 30;
      s.window_right = 3;
      s.causal = false;
    }
    s.softcap = i == 2 || i == 4 ? 5.0f : 0.0f;
    s.alibi = i >= 3;
    run_case(s);
  }
}

TEST(KvCache, HeadDimsAndGroups) {
  const int dims[] = {59, 64, 111, 128, 256};
  const int groups[][2] = {{4, 4}, {8, 2}, {6, 1}, {4, 1}, {2, 2}};
  for (int i = 0; i < 5; ++i) {
    KvShape s = base(dims[i], i % 2 ? DType::f16 : DType::bf16);
    s.h = groups[i][0];
    s.h_k = groups[i][1];
    s.s_q = 1 + i;
    s.s_new = 1;
    s.page_size = i == 2 ? 3 : (i == 4 ? 64 : 0);
    s.capacity = 80;
    s.causal = true;
    s.rotary_dim = dims[i] % 2 == 0 ? dims[i] / 2 : 32;
    s.interleaved = i % 2 == 0;
    run_case(s);
  }
}

// The decoding path (few query rows per KV head: flash_forward_decode reads the cache in place)
// and the boundary where flash_forward switches to the tiled path (s_q · group > 32: s_q 16 to 17
// at group 2, 8 to 9 at group 4).
TEST(KvCacheDecode, PagesBatchIndexAndLeftpad) {
  for (int page : {0, 1, 3, 16, 64})
    for (DType t : {DType::f32, DType::bf16}) {
      KvShape s = base(128, t);
      s.page_size = page;
      s.capacity = 300;  // up to 5 chunks of 64 keys, a split each (3 items: batch entries)
      s.b = 3;
      s.h = 8;
      s.h_k = 2;
      s.s_q = t == DType::f32 ? 1 : 2;
      s.s_new = 1;
      s.batch_idx = page == 0;
      s.leftpad = page != 16;
      s.causal = page % 2 == 1;
      run_case(s);
    }
}

// Caches held head-major ((b, h_k, s, d) or (pages, h_k, page_size, d) memory, as HF transformers
// keeps them), passed as strided views: the append writes there and both CPU mainloops read there,
// with rotary, GQA and MHA, at 1 and 16 threads (task_heads' head-major rule).
TEST(KvCacheDecode, HeadMajorCaches) {
  for (int page : {0, 16})
    for (DType t : {DType::f32, DType::bf16})
      for (int sq : {1, 4, 12}) {
        KvShape s = base(64, t);
        s.head_major = true;
        s.page_size = page;
        s.capacity = 200;
        s.b = 2;
        s.h = 8;
        s.h_k = sq == 4 ? 8 : 2;
        s.s_q = sq;
        s.s_new = sq == 12 ? 3 : 1;
        s.rotary_dim = 32;
        s.interleaved = page == 0;
        s.causal = true;
        s.threads = t == DType::f32 ? 16 : 1;
        run_case(s);
      }
}

TEST(KvCacheDecode, QueryRowsAcrossTheSwitchWithMasksAndScoreMods) {
  for (int sq = 1; sq <= 17; ++sq)
    for (int group : {1, 2, 4}) {
      KvShape s = base(64, sq % 2 ? DType::f32 : DType::bf16);
      s.s_q = sq;
      s.s_new = sq % 3;
      s.h = 2 * group;
      s.h_k = 2;
      s.capacity = 200;
      s.page_size = sq % 4 == 0 ? 0 : 16;
      switch (sq % 5) {
        case 0: s.causal = true; break;
        case 1: s.window_left = 40; s.window_right = 0; break;
        case 2: s.softcap = 4.0f; s.causal = true; break;
        case 3: s.alibi = true; break;
        case 4: s.window_left = 70; s.window_right = 5; s.alibi = true; s.softcap = 6.0f; break;
      }
      run_case(s);
    }
}

TEST(KvCacheDecode, HeadDimsGroupsAndDtypes) {
  const int dims[] = {59, 64, 111, 128, 256};
  const int groups[][2] = {{8, 8}, {8, 2}, {8, 1}, {16, 1}, {4, 2}};
  for (int i = 0; i < 5; ++i)
    for (DType t : {DType::f32, DType::bf16}) {
      KvShape s = base(dims[i], t);
      s.h = groups[i][0];
      s.h_k = groups[i][1];
      s.s_q = 1;
      s.s_new = 1;
      s.capacity = 150;
      s.page_size = i % 2 ? 3 : 0;
      s.causal = true;
      s.softcap = i == 3 ? 8.0f : 0.0f;
      s.alibi = i == 4;
      run_case(s);
    }
}

TEST(KvCacheDecode, ManyHeadsInUnevenHeadGroups) {
  // 12 KV heads of 256: tasks over groups of 8 and 4 KV heads (kDecodeGroupHeads), 32-key chunks
  // (decode_chunk_keys), up to 4 splits of 100 keys; at 16 threads groups of 1 or 2 KV heads
  // (task_heads) over the same chunks.
  KvShape s = base(256, DType::bf16);
  s.b = 1;
  s.h = 24;
  s.h_k = 12;
  s.capacity = 100;
  s.s_q = 1;
  s.page_size = 3;
  s.window_left = 50;
  s.window_right = 0;
  for (int threads : {0, 16}) {
    s.threads = threads;
    run_case(s);
  }
}

TEST(KvCacheDecode, SplitsOnAndOff) {
  KvShape on = base(64, DType::f32);  // 1 item (batch entry): 8 splits of the 15 chunks of 64 keys
  on.b = 1;
  on.h = 8;
  on.h_k = 2;
  on.capacity = 1000;
  on.held = 900;
  on.page_size = 64;
  on.causal = true;
  run_case(on);
  KvShape off = on;  // 64 items: no splits, up to 4 chunks each
  off.b = 64;
  off.h_k = 4;
  off.held = -1;
  off.capacity = 200;
  off.dtype = DType::bf16;
  off.leftpad = true;
  run_case(off);
}

TEST(KvCacheDecode, EmptyCaches) {
  for (int page : {0, 3}) {
    KvShape s = base(64, DType::f32);
    s.page_size = page;
    s.held = 0;
    s.s_new = 0;
    s.b = 3;
    s.h = 8;
    s.h_k = 2;
    run_case(s);
  }
}

// No query row: nothing to attend, but the new rows are still written (k rotated).
TEST(KvCacheDecode, NoQueryRowStillAppends) {
  for (int page : {0, 3}) {
    KvShape s = base(64, DType::bf16);
    s.page_size = page;
    s.s_q = 0;
    s.s_new = 2;
    s.rotary_dim = 32;
    run_case(s);
  }
}

TEST(KvCache, QueryPositionsPastTheRotaryTableTakeItsLastRow) {
  // A full cache, 4 queries, 1 appended key, causal: queries 1..3 sit past the cos/sin rows.
  KvShape s = base(64, DType::bf16);
  s.full = true;
  s.s_q = 4;
  s.s_new = 1;
  s.causal = true;
  s.rotary_dim = 64;
  s.page_size = 3;
  run_case(s);
}

TEST(KvCache, WindowPastTheCacheIsNoWindow) {
  // flash-attn's normalisation: window_left >= capacity is unbounded, so rotary positions are the
  // non-windowed ones (every query at seqlens) when the call is not causal.
  KvShape s = base(64, DType::f32);
  s.rotary_dim = 64;
  s.s_q = 3;
  s.s_new = 3;
  KvProblem pb(s);
  pb.opt.window_left = pb.capacity;
  const auto want = pb.expected(Precision::f64);  // expected() rotates with per-row positions off
  HostTensor kc = pb.k_cache, vc = pb.v_cache, out = pb.new_out(), lse = pb.new_lse();
  kc.view.data = kc.buf.data();
  vc.view.data = vc.buf.data();
  Context ctx;
  ctx.cpu_algorithm = CpuAlgorithm::reference;
  flashmonoid::forward_kvcache(pb.q.view, pb.cache(kc, vc), pb.k_new.view, pb.v_new.view, pb.rotary(), out.view,
                               lse.view, pb.opt, ctx);
  EXPECT_EQ(max_abs_diff(out.values(), want.out), 0.0);
}

// Paged prefill: forward_varlen over pages equals forward_varlen over the packed keys.
TEST(KvCache, PagedVarlen) {
  for (int page : {1, 3, 16, 256}) {
    Shape sh;
    sh.b = 3;
    sh.h = 4;
    sh.h_k = 2;
    sh.d = 40;
    sh.dtype = DType::bf16;
    sh.varlen = true;
    sh.lens_q = {5, 1, 9};
    sh.lens_k = {5, 30, 12};
    sh.causal = true;
    sh.padded_strides = false;
    Problem pb(sh);
    const int max_pages = (30 + page - 1) / page, num_pages = 3 * max_pages + 1;
    std::vector<int> perm(num_pages);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng());
    HostTensor bt(DType::i32, {3, max_pages}), kp(sh.dtype, {num_pages, page, 2, 40}), vp(sh.dtype, {num_pages, page, 2, 40});
    kp.poison();
    vp.poison();
    const int* ck = pb.cu_k.view.ptr<int>();
    for (int i = 0; i < 3; ++i) {
      for (int j = 0; j < max_pages; ++j) bt.view.ptr<int>()[i * max_pages + j] = perm[i * max_pages + j];
      for (int j = 0; j < ck[i + 1] - ck[i]; ++j)
        for (int e = 0; e < 2 * 40; ++e) {
          const std::int64_t dst = (static_cast<std::int64_t>(perm[i * max_pages + j / page]) * page + j % page) * 80 + e;
          kp.set(dst, pb.k.get((static_cast<std::int64_t>(ck[i]) + j) * 80 + e));
          vp.set(dst, pb.v.get((static_cast<std::int64_t>(ck[i]) + j) * 80 + e));
        }
    }
    flashmonoid::Varlen vl = pb.vl;
    vl.block_table = bt.view;
    // The key counts as flash-attn 3's paged form gives them: seqused_k alone (no cu_seqlens_k), or
    // with cu_seqlens_k slots of a whole sequence's pages (the count is the smaller of the two).
    HostTensor used(DType::i32, {3}), wide(DType::i32, {4});
    for (int i = 0; i < 3; ++i) used.view.ptr<int>()[i] = ck[i + 1] - ck[i];
    for (int i = 0; i < 4; ++i) wide.view.ptr<int>()[i] = i * max_pages * page;
    flashmonoid::Varlen by_used = vl, by_both = vl;
    by_used.cu_seqlens_k = {};
    by_used.seqused_k = by_both.seqused_k = used.view;
    by_both.cu_seqlens_k = wide.view;
    for (CpuAlgorithm algo : {CpuAlgorithm::reference, CpuAlgorithm::flash}) {
      Context ctx;
      ctx.cpu_algorithm = algo;
      auto [o_want, l_want] = pb.forward(ctx);
      for (const flashmonoid::Varlen* form : {&vl, &by_used, &by_both}) {
        SCOPED_TRACE("page " + std::to_string(page) + (algo == CpuAlgorithm::reference ? " reference" : " flash") +
                     (form == &vl ? "" : form == &by_used ? ", seqused_k" : ", seqused_k and wide cu_seqlens_k"));
        HostTensor o = pb.new_out(), l = pb.new_lse();
        flashmonoid::forward_varlen(pb.q.view, kp.view, vp.view, *form, o.view, l.view, pb.opt, ctx);
        EXPECT_EQ(max_abs_diff(o.values(), o_want.values()), 0.0);
        EXPECT_EQ(max_abs_diff(l.values(), l_want.values()), 0.0);
      }
    }
  }
}

TEST(KvCache, RotaryMatchesFloat64Rotation) {
  // detail::rotate against the rotation written out in float64, both pair styles.
  std::normal_distribution<double> n(0.0, 1.0);
  for (int trial = 0; trial < 1000; ++trial) {
    const double a = n(rng()) * 3.0, x = n(rng()), y = n(rng());
    float ya, yb;
    flashmonoid::detail::rotate(static_cast<float>(x), static_cast<float>(y), static_cast<float>(std::cos(a)),
                                static_cast<float>(std::sin(a)), &ya, &yb);
    const double c = static_cast<float>(std::cos(a)), s = static_cast<float>(std::sin(a));
    const double xf = static_cast<float>(x), yf = static_cast<float>(y);
    EXPECT_NEAR(ya, xf * c - yf * s, 1e-6 * (std::abs(xf) + std::abs(yf)));
    EXPECT_NEAR(yb, xf * s + yf * c, 1e-6 * (std::abs(xf) + std::abs(yf)));
  }
  EXPECT_EQ(flashmonoid::detail::rotary_pair(3, 16, true).a, 6);
  EXPECT_EQ(flashmonoid::detail::rotary_pair(3, 16, true).b, 7);
  EXPECT_EQ(flashmonoid::detail::rotary_pair(3, 16, false).a, 3);
  EXPECT_EQ(flashmonoid::detail::rotary_pair(3, 16, false).b, 11);
}

// ---- errors ---------------------------------------------------------------------------------------

struct ErrorCall {
  KvProblem pb;
  HostTensor out, lse;
  explicit ErrorCall(KvShape s) : pb(s), out(pb.new_out()), lse(pb.new_lse()) {}
  static KvShape shape(int page) {
    KvShape s;
    s.b = 2;
    s.s_q = 2;
    s.s_new = 2;
    s.h = 4;
    s.h_k = 2;
    s.d = 16;
    s.capacity = 32;
    s.page_size = page;
    s.rotary_dim = 8;
    return s;
  }
  void run(const flashmonoid::KVCache& c, const TensorView& kn, const TensorView& vn, const flashmonoid::Rotary& r,
           const flashmonoid::Options& o) {
    flashmonoid::forward_kvcache(pb.q.view, c, kn, vn, r, out.view, lse.view, o);
  }
  void run(const flashmonoid::KVCache& c) { run(c, pb.k_new.view, pb.v_new.view, pb.rotary(), pb.opt); }
  flashmonoid::KVCache cache() const { return pb.cache(pb.k_cache, pb.v_cache); }
  // The call on the valid cache after change(cache) fails naming argument, with rule in the message.
  template <class F>
  void expect_cache_error(F change, const std::string& argument, const std::string& rule) {
    flashmonoid::KVCache c = cache();
    change(c);
    expect_error([&] { run(c); }, argument, rule);
  }
};

TEST(KvCacheErrors, CacheLayout) {
  ErrorCall e(ErrorCall::shape(0));
  auto c = e.cache();
  HostTensor k16(DType::f16, {2, 32, 2, 16});
  c.k = k16.view;
  expect_error([&] { e.run(c); }, "k_cache", "dtype fp16 differs from q's fp32");
  c = e.cache();
  HostTensor k3(DType::f32, {2, 32, 3, 16});
  c.k = c.v = k3.view;
  expect_error([&] { e.run(c); }, "k_cache", "must be a multiple of the number of KV heads (3)");
  c = e.cache();
  HostTensor kd(DType::f32, {2, 32, 2, 8});
  c.k = kd.view;
  expect_error([&] { e.run(c); }, "k_cache", "head dim 8 differs from q's 16");
  c = e.cache();
  HostTensor v2(DType::f32, {2, 31, 2, 16});
  c.v = v2.view;
  expect_error([&] { e.run(c); }, "v_cache", "the shape of k_cache");
  c = e.cache();
  HostTensor small(DType::f32, {1, 32, 2, 16});
  c.k = c.v = small.view;
  expect_error([&] { e.run(c); }, "k_cache", "pass batch_idx");
}

TEST(KvCacheErrors, IndexTensors) {
  ErrorCall e(ErrorCall::shape(0));
  auto c = e.cache();
  HostTensor f(DType::f32, {2});
  c.seqlens = f.view;
  expect_error([&] { e.run(c); }, "seqlens", "dtype must be int32");
  c = e.cache();
  HostTensor three(DType::i32, {3});
  c.leftpad = three.view;
  expect_error([&] { e.run(c); }, "leftpad", "must be (2)");
  c = e.cache();
  HostTensor bad(DType::i32, {2});
  bad.view.ptr<int>()[0] = 31;  // + 2 appended > 32
  bad.view.ptr<int>()[1] = 0;
  c.seqlens = bad.view;
  expect_error([&] { e.run(c); }, "seqlens", "must stay within [0, 32]");
  c = e.cache();
  HostTensor lp(DType::i32, {2});
  lp.view.ptr<int>()[0] = e.pb.held[0] + 1;
  lp.view.ptr<int>()[1] = 0;
  c.leftpad = lp.view;
  expect_error([&] { e.run(c); }, "leftpad", "must be in [0, seqlens[0]");
  c = e.cache();
  HostTensor bi(DType::i32, {2});
  bi.view.ptr<int>()[0] = 0;
  bi.view.ptr<int>()[1] = 2;
  c.batch_idx = bi.view;
  expect_error([&] { e.run(c); }, "batch_idx", "is not a cache entry in [0, 2)");
  c = e.cache();
  c.seqlens = {};
  c.seqlen = 33;
  expect_error([&] { e.run(c); }, "seqlen", "must be in [0, capacity = 32]");
}

TEST(KvCacheErrors, Pages) {
  ErrorCall e(ErrorCall::shape(8));
  auto c = e.cache();
  HostTensor bt(DType::i32, {3, 4});
  c.block_table = bt.view;
  expect_error([&] { e.run(c); }, "block_table", "q's batch b = 2");
  c = e.cache();
  HostTensor bt64(DType::f32, {2, 4});
  c.block_table = bt64.view;
  expect_error([&] { e.run(c); }, "block_table", "dtype must be int32");
  c = e.cache();
  HostTensor bi(DType::i32, {2});
  c.batch_idx = bi.view;
  expect_error([&] { e.run(c); }, "batch_idx", "takes no batch index");
  c = e.cache();
  HostTensor wrong(DType::i32, {2, 4});
  for (int i = 0; i < 8; ++i) wrong.view.ptr<int>()[i] = e.pb.num_pages;  // one past the last page
  c.block_table = wrong.view;
  c.seqlens = {};
  c.seqlen = 4;
  expect_error([&] { e.run(c); }, "block_table", "is not a page index in [0, " + std::to_string(e.pb.num_pages) + ")");
}

// The page pool's and the block table's layout, each with the argument it names.
TEST(KvCacheErrors, PageLayout) {
  ErrorCall e(ErrorCall::shape(8));
  HostTensor empty_pages(DType::f32, {e.pb.num_pages, 0, 2, 16}), no_pages(DType::f32, {0, 8, 2, 16});
  HostTensor no_columns(DType::i32, {2, 0}), flat(DType::i32, {8});
  e.expect_cache_error([&](auto& c) { c.k = c.v = empty_pages.view; }, "k_cache", "page size (dim 1) must be >= 1, got 0");
  e.expect_cache_error([&](auto& c) { c.k = c.v = no_pages.view; }, "k_cache", "must hold at least one page");
  e.expect_cache_error([&](auto& c) { c.block_table = no_columns.view; }, "block_table", "at least one page per sequence");
  e.expect_cache_error([&](auto& c) { c.block_table = flat.view; }, "block_table", "expected 2 dimensions");
  e.expect_cache_error([&](auto& c) { c.block_table.device = flashmonoid::Device::cuda(0); }, "block_table",
                       "all tensors must share a device");
  // 4 pages of 2^30 rows (one real page of memory, the rows at stride 0): capacity past int32.
  const TensorView huge(e.pb.k_cache.view.data, DType::f32, e.pb.q.view.device,
                        {e.pb.num_pages, std::int64_t{1} << 30, 2, 16}, {0, 0, 16, 1});
  e.expect_cache_error([&](auto& c) { c.k = c.v = huge; }, "block_table", "size 4294967296 exceeds 2^31 - 1");
}

// Sizes past int32 in the other host-visible dimensions, with one real row at stride 0.
TEST(KvCacheErrors, SizesPastInt32) {
  ErrorCall e(ErrorCall::shape(0));
  const std::int64_t big = std::int64_t{1} << 31;
  const TensorView entries(e.pb.k_cache.view.data, DType::f32, e.pb.q.view.device, {big, 32, 2, 16}, {0, 32, 16, 1});
  e.expect_cache_error([&](auto& c) { c.k = c.v = entries; }, "k_cache", "size 2147483648 exceeds 2^31 - 1");
  auto r = e.pb.rotary();
  r.cos = r.sin = TensorView(r.cos.data, DType::f32, e.pb.q.view.device, {big, 4}, {0, 1});
  expect_error([&] { e.run(e.cache(), e.pb.k_new.view, e.pb.v_new.view, r, e.pb.opt); }, "rotary.cos",
               "size 2147483648 exceeds 2^31 - 1");
  const TensorView q3(e.pb.q.view.data, DType::f32, e.pb.q.view.device, {2, 2, 64});
  expect_error([&] { flashmonoid::forward_kvcache(q3, e.cache(), e.pb.k_new.view, e.pb.v_new.view, e.pb.rotary(),
                                                  e.out.view, e.lse.view, e.pb.opt); },
               "q", "expected 4 dimensions");
}

TEST(KvCacheErrors, IndexTensorLayout) {
  ErrorCall e(ErrorCall::shape(0));
  HostTensor column(DType::i32, {2, 1}), every_other(DType::i32, {2}, {2}), idx(DType::i32, {2});
  TensorView idx_on_gpu = idx.view;
  idx_on_gpu.device = flashmonoid::Device::cuda(0);
  e.expect_cache_error([&](auto& c) { c.seqlens = column.view; }, "seqlens", "expected 1 dimensions");
  e.expect_cache_error([&](auto& c) { c.leftpad = every_other.view; }, "leftpad", "last dimension must be contiguous");
  e.expect_cache_error([&](auto& c) { c.batch_idx = idx_on_gpu; }, "batch_idx", "all tensors must share a device");
}

// forward_varlen over pages: the same layout rules, naming k and v, and the pages' capacity
// checked against cu_seqlens_k on the host.
TEST(KvCacheErrors, PagedVarlen) {
  const int page = 4, num_pages = 5;
  HostTensor q(DType::f32, {5, 2, 8}), out(DType::f32, {5, 2, 8}), lse(DType::f32, {2, 5});
  HostTensor kp(DType::f32, {num_pages, page, 2, 8}), vp(DType::f32, {num_pages, page, 2, 8});
  HostTensor cu_q(DType::i32, {3}), cu_k(DType::i32, {3}), bt(DType::i32, {2, 3});
  for (HostTensor* t : {&q, &kp, &vp}) t->fill_normal();
  const int cq[] = {0, 2, 5}, ck[] = {0, 3, 9}, table[] = {4, 0, 0, 2, 1, 3};
  std::memcpy(cu_q.view.data, cq, sizeof(cq));
  std::memcpy(cu_k.view.data, ck, sizeof(ck));
  std::memcpy(bt.view.data, table, sizeof(table));
  flashmonoid::Varlen vl{cu_q.view, cu_k.view, 3, 12};
  vl.block_table = bt.view;
  TensorView k = kp.view, v = vp.view, o = out.view;
  auto run = [&] { flashmonoid::forward_varlen(q.view, k, v, vl, o, lse.view, flashmonoid::Options{}); };
  run();  // the valid call the errors below start from
  HostTensor empty_pages(DType::f32, {num_pages, 0, 2, 8});
  k = v = empty_pages.view;
  expect_error(run, "k", "page size (dim 1) must be >= 1, got 0");
  k = kp.view;
  HostTensor short_v(DType::f32, {num_pages, page - 1, 2, 8});
  v = short_v.view;
  expect_error(run, "v", "the shape of k");
  v = vp.view;
  HostTensor k_heads(DType::f32, {num_pages, page, 3, 8});
  k = v = k_heads.view;
  expect_error(run, "k", "must be a multiple of the number of KV heads (3)");
  k = kp.view;
  v = vp.view;
  int* c = cu_k.view.ptr<int>();
  c[2] = 16;  // 13 keys in 3 pages of 4
  vl.max_seqlen_k = 13;
  expect_error(run, "cu_seqlens_k", "sequence 1 has 13 keys but its pages hold 12");
  c[2] = 9;
  vl.max_seqlen_k = 12;
  int* t = bt.view.ptr<int>();
  t[4] = num_pages;  // sequence 1's second page
  expect_error(run, "block_table", "entry (1, 1) = 5 is not a page index in [0, 5)");
  t[4] = 1;
  HostTensor bt3(DType::i32, {3, 3});
  vl.block_table = bt3.view;
  expect_error(run, "block_table", "q's batch b = 2");
  vl.block_table = bt.view;
  o = TensorView(kp.view.data, DType::f32, q.view.device, {5, 2, 8});
  expect_error(run, "out", "overlaps the memory of k");
  o = out.view;
  // Key counts by seqused_k (cu_seqlens_k optional): int32 (b), within the pages and max_seqlen_k.
  HostTensor used(DType::i32, {2}), used3(DType::i32, {3}), used_f(DType::f32, {2});
  int* u = used.view.ptr<int>();
  u[0] = 3;
  u[1] = 6;
  vl.seqused_k = used.view;
  run();
  const TensorView cu_k_view = vl.cu_seqlens_k;
  vl.cu_seqlens_k = {};
  run();
  u[1] = 13;
  vl.max_seqlen_k = 13;
  expect_error(run, "seqused_k", "sequence 1 has 13 keys but its pages hold 12");
  vl.max_seqlen_k = 12;
  u[1] = -1;
  expect_error(run, "seqused_k", "entry 1 (-1) is negative");
  u[1] = 10;
  vl.max_seqlen_k = 8;
  expect_error(run, "seqused_k", "sequence 1 has 10 keys > max_seqlen_k = 8");
  vl.max_seqlen_k = 12;
  vl.seqused_k = used3.view;
  expect_error(run, "seqused_k", "one entry per sequence");
  vl.seqused_k = used_f.view;
  expect_error(run, "seqused_k", "dtype must be int32");
  vl.seqused_k = {};
  expect_error(run, "cu_seqlens_k", "required for a paged varlen call unless seqused_k gives the key counts");
  vl.cu_seqlens_k = cu_k_view;
  vl.seqused_q = used.view;
  expect_error(run, "seqused_q", "with a block_table cu_seqlens_q gives each sequence's query rows");
}

TEST(KvCacheErrors, NewRowsRotaryAndOptions) {
  ErrorCall e(ErrorCall::shape(0));
  const auto c = e.cache();
  HostTensor kn(DType::f32, {2, 2, 1, 16});
  expect_error([&] { e.run(c, kn.view, e.pb.v_new.view, e.pb.rotary(), e.pb.opt); }, "k_new", "(b, s_new, h_k, d)");
  expect_error([&] { e.run(c, e.pb.k_new.view, TensorView{}, e.pb.rotary(), e.pb.opt); }, "v_new", "go together");
  HostTensor big(DType::f32, {2, 33, 2, 16});
  expect_error([&] { e.run(c, big.view, big.view, e.pb.rotary(), e.pb.opt); }, "k_new", "at most 32 per sequence");
  auto r = e.pb.rotary();
  r.sin = {};
  expect_error([&] { e.run(c, e.pb.k_new.view, e.pb.v_new.view, r, e.pb.opt); }, "rotary.sin", "both cos and sin");
  HostTensor cs(DType::f32, {32, 9});  // rotary_dim 18 > d 16
  r = e.pb.rotary();
  r.cos = r.sin = cs.view;
  expect_error([&] { e.run(c, e.pb.k_new.view, e.pb.v_new.view, r, e.pb.opt); }, "rotary.cos", "2 <= rotary_dim <= head dim 16");
  HostTensor shortcs(DType::f32, {31, 4});
  r.cos = r.sin = shortcs.view;
  expect_error([&] { e.run(c, e.pb.k_new.view, e.pb.v_new.view, r, e.pb.opt); }, "rotary.cos", "holds up to 32 rows");
  HostTensor cs16(DType::f16, {32, 4});
  r.cos = r.sin = cs16.view;
  expect_error([&] { e.run(c, e.pb.k_new.view, e.pb.v_new.view, r, e.pb.opt); }, "rotary.cos", "differs from q's fp32");
  auto o = e.pb.opt;
  o.dropout_p = 0.1f;
  expect_error([&] { e.run(c, e.pb.k_new.view, e.pb.v_new.view, e.pb.rotary(), o); }, "options.dropout_p", "not available");
  const TensorView in_cache(e.pb.k_cache.view.data, DType::f32, e.pb.q.view.device, {2, 2, 4, 16});
  expect_error([&] { flashmonoid::forward_kvcache(e.pb.q.view, c, e.pb.k_new.view, e.pb.v_new.view, e.pb.rotary(),
                                                  in_cache, e.lse.view, e.pb.opt); },
               "out", "overlaps the memory of k_cache");
}

TEST(KvCacheErrors, QueryNewRowsRotaryAndCacheAliasing) {
  ErrorCall e(ErrorCall::shape(0));
  const auto c = e.cache();
  const auto r = e.pb.rotary();
  HostTensor qi(DType::i32, {2, 2, 4, 16});
  expect_error([&] { flashmonoid::forward_kvcache(qi.view, c, e.pb.k_new.view, e.pb.v_new.view, r, e.out.view,
                                                  e.lse.view, e.pb.opt); },
               "q", "dtype must be fp32, fp16 or bf16");
  HostTensor no_heads(DType::f32, {2, 32, 0, 16});
  e.expect_cache_error([&](auto& c2) { c2.k = c2.v = no_heads.view; }, "k_cache", "must have at least one head");
  e.expect_cache_error(
      [](auto& c2) {
        c2.seqlens = {};
        c2.seqlen = 31;  // + 2 appended > 32
      },
      "seqlen", "31 rows held + 2 appended exceed the capacity 32");
  // The append writes the cache: one buffer for k and v would be read after the write.
  e.expect_cache_error([](auto& c2) { c2.v = c2.k; }, "k_cache", "overlaps the memory of v_cache");
  const TensorView q_in_cache(e.pb.k_cache.view.data, DType::f32, e.pb.q.view.device, {2, 2, 4, 16});
  expect_error([&] { flashmonoid::forward_kvcache(q_in_cache, c, e.pb.k_new.view, e.pb.v_new.view, r, e.out.view,
                                                  e.lse.view, e.pb.opt); },
               "k_cache", "overlaps the memory of q");

  expect_error([&] { e.run(c, TensorView{}, e.pb.v_new.view, r, e.pb.opt); }, "k_new", "go together");
  HostTensor k16(DType::f16, {2, 2, 2, 16}), v8(DType::f32, {2, 2, 2, 8});
  expect_error([&] { e.run(c, k16.view, e.pb.v_new.view, r, e.pb.opt); }, "k_new", "dtype fp16 differs from q's fp32");
  expect_error([&] { e.run(c, e.pb.k_new.view, v8.view, r, e.pb.opt); }, "v_new", "the shape of k_new");

  HostTensor sin3(DType::f32, {32, 3}), cos1(DType::f32, {32});
  auto r2 = r;
  r2.cos = {};
  expect_error([&] { e.run(c, e.pb.k_new.view, e.pb.v_new.view, r2, e.pb.opt); }, "rotary.cos", "both cos and sin");
  r2 = r;
  r2.sin = sin3.view;
  expect_error([&] { e.run(c, e.pb.k_new.view, e.pb.v_new.view, r2, e.pb.opt); }, "rotary.sin", "the shape of rotary.cos");
  r2 = r;
  r2.cos = cos1.view;
  expect_error([&] { e.run(c, e.pb.k_new.view, e.pb.v_new.view, r2, e.pb.opt); }, "rotary.cos", "expected 2 dimensions");
}

}  // namespace
}  // namespace fmtest
