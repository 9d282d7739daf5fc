// CUDA forward_kvcache against the CPU float64 reference on the gathered keys (kvcache_case.hpp):
// contiguous and paged caches (pages 1, 3, 8, 16, 32, 64, 256, shuffled tables), batch index, leftpad,
// cache_seqlens as a tensor or one host int, calls without new rows, appends crossing pages,
// rotary both styles with rotary_dim < d, s_q 1..17 with causal among the new tokens, windows,
// softcap, ALiBi, GQA/MQA, forced splits, split blocks sharing their key tiles; the cache bytes
// after the append equal the CPU's (same rotary bits); CUDA graphs captured once and replayed with
// new seqlens / block-table / data; lengths and pages written by the kernel just before the call;
// values only the device sees (seqlens past the capacity, pages past num_pages) run without a fault
// (run this binary under compute-sanitizer memcheck for the proof).
// Outputs are NaN-poisoned before every launch; unused cache rows and pages hold NaN.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <array>
#include <cstring>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "device_tensor.hpp"
#include "common/pdl.cuh"
#include "kvcache_case.hpp"
#include "sm80/fwd_sm80.hpp"
#include "sm80/tile_fwd_sm80.hpp"

namespace fmtest {
namespace {

using flashmonoid::CallLaunch;
using flashmonoid::Context;
using flashmonoid::cpu::Precision;

// Device copies of a problem's inputs, outputs and caches, and the call on them.
struct DeviceKv {
  const KvProblem& pb;
  DeviceTensor q, k_new, v_new, k_cache, v_cache, block_table, batch_idx, seqlens, leftpad, cos, sin, alibi;
  HostTensor out_h, lse_h;
  DeviceTensor out, lse;
  std::unique_ptr<DeviceBuffer> work;
  flashmonoid::Options opt;
  flashmonoid::KVCache cache;
  flashmonoid::Rotary rotary;

  DeviceKv(const KvProblem& p, int splits)
      : pb(p), q(p.q), k_new(p.k_new), v_new(p.v_new), k_cache(p.k_cache), v_cache(p.v_cache),
        block_table(p.block_table), batch_idx(p.batch_idx), seqlens(p.seqlens), leftpad(p.leftpad), cos(p.cos),
        sin(p.sin), alibi(p.alibi), out_h(p.new_out()), lse_h(p.new_lse()), out(out_h), lse(lse_h) {
    opt = p.opt;
    if (p.s.alibi) opt.alibi_slopes = alibi.view;
    cache = p.cache(p.k_cache, p.v_cache);
    cache.k = k_cache.view;
    cache.v = v_cache.view;
    if (cache.block_table.defined()) cache.block_table = block_table.view;
    if (cache.batch_idx.defined()) cache.batch_idx = batch_idx.view;
    if (cache.seqlens.defined()) cache.seqlens = seqlens.view;
    if (cache.leftpad.defined()) cache.leftpad = leftpad.view;
    rotary = p.rotary();
    rotary.cos = cos.view;
    rotary.sin = sin.view;
    // The queried size, plus room for forced splits: (d + 1) fp32 per (split, head, row).
    const std::size_t need = flashmonoid::forward_kvcache_workspace_size(q.view, cache, k_new.view, rotary, opt);
    work = std::make_unique<DeviceBuffer>(need + static_cast<std::size_t>(splits) * p.s.h * p.s.b * p.s.s_q *
                                                     (p.s.d + 1) * 4 + 4096);
  }
  // Another problem of the same shapes into these device buffers (lengths, pages, leftpad, data),
  // outputs poisoned again; the caches are written as they are, so the call sees only p's values.
  void load(const KvProblem& p) {
    for (auto [dev, host] : {std::pair{&q, &p.q}, {&k_new, &p.k_new}, {&v_new, &p.v_new}, {&k_cache, &p.k_cache},
                             {&v_cache, &p.v_cache}, {&block_table, &p.block_table}, {&batch_idx, &p.batch_idx},
                             {&seqlens, &p.seqlens}, {&leftpad, &p.leftpad}, {&cos, &p.cos}, {&sin, &p.sin},
                             {&alibi, &p.alibi}})
      dev->copy_from(*host);
    out.copy_from(p.new_out());
    lse.copy_from(p.new_lse());
  }
  void run(int splits, cudaStream_t stream = nullptr, CallLaunch launch = CallLaunch::automatic) {
    Context ctx;
    ctx.stream = stream;
    ctx.call_launch = launch;
    ctx.workspace = work->ptr;
    ctx.workspace_bytes = work->bytes;
    ctx.num_splits = splits;
    flashmonoid::forward_kvcache(q.view, cache, k_new.view, v_new.view, rotary, out.view, lse.view, opt, ctx);
  }
};

void check_results(const KvProblem& pb, DeviceKv& d) {
  cuda_ok(cudaDeviceSynchronize());
  HostTensor out = pb.new_out(), lse = pb.new_lse(), kc = pb.k_cache, vc = pb.v_cache;
  d.out.copy_to(out);
  d.lse.copy_to(lse);
  d.k_cache.copy_to(kc);
  d.v_cache.copy_to(vc);
  const auto [k_want, v_want] = pb.expected_cache();
  EXPECT_TRUE(same_bytes(kc, k_want)) << "k_cache after the append differs from the CPU's";
  EXPECT_TRUE(same_bytes(vc, v_want)) << "v_cache after the append differs from the CPU's";
  const auto want = pb.expected(Precision::f64, /*fp32_out=*/true);
  const auto lowp = pb.expected(Precision::input);
  expect_close("out", pb.s.dtype, out.values(), want.out, lowp.out);
  EXPECT_LE(max_abs_diff(lse.values(), want.lse), 1e-5 * std::max(1.0, max_abs(want.lse))) << "lse";
}

void run_case(const KvShape& s, int splits = 0) {
  SCOPED_TRACE(s.str() + " splits " + std::to_string(splits));
  KvProblem pb(s);
  DeviceKv d(pb, splits);
  d.run(splits);
  check_results(pb, d);
}

// Random bytes over a workspace: a call must not depend on what an earlier one left there.
void fill_random(DeviceBuffer& work) {
  std::vector<unsigned char> noise(work.bytes);
  std::mt19937 rng(std::random_device{}());
  for (auto& x : noise) x = static_cast<unsigned char>(rng());
  cuda_ok(cudaMemcpy(work.ptr, noise.data(), noise.size(), cudaMemcpyHostToDevice));
}

// One CUDA graph capture of s's call (ctx.num_splits = splits), replayed three times with new
// lengths, pages, leftpad and data (same shapes), each replay checked: nothing the host saw at
// capture time is baked into the graph except shapes and pointers.
void capture_and_replay(const KvShape& s, int splits) {
  KvProblem first(s);
  DeviceKv d(first, splits);
  cudaStream_t stream;
  cuda_ok(cudaStreamCreate(&stream));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  cuda_ok(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  d.run(splits, stream);
  cuda_ok(cudaStreamEndCapture(stream, &graph));
  cuda_ok(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 3; ++replay) {
    KvProblem next(s);
    d.load(next);
    cuda_ok(cudaGraphLaunch(exec, stream));
    SCOPED_TRACE("replay " + std::to_string(replay));
    check_results(next, d);
  }
  cuda_ok(cudaGraphExecDestroy(exec));
  cuda_ok(cudaGraphDestroy(graph));
  cuda_ok(cudaStreamDestroy(stream));
}

KvShape decode_shape(DType t) {
  KvShape s;
  s.dtype = t;
  s.b = 3;
  s.h = 8;
  s.h_k = 2;
  s.d = 128;
  s.capacity = 700;
  s.causal = true;
  return s;
}

TEST(KvCacheCuda, Layouts) {
  SKIP_WITHOUT_GPU();
  for (int page : {0, 1, 2, 3, 8, 16, 32, 64, 256}) {
    KvShape s = decode_shape(page % 2 ? DType::f16 : DType::bf16);
    s.page_size = page;
    s.s_new = 5;
    s.s_q = 5;
    s.batch_idx = page == 0;
    s.leftpad = page != 16 && page != 32;
    run_case(s);
  }
}

// Caches that hold no row and get none appended: out = 0, lse = -inf for every query, on each
// layout and with forced splits (every split empty).
TEST(KvCacheCuda, EmptyCaches) {
  SKIP_WITHOUT_GPU();
  for (int page : {0, 3, 16}) {
    KvShape s = decode_shape(page == 3 ? DType::f16 : DType::bf16);
    s.page_size = page;
    s.held = 0;
    s.s_new = 0;
    s.s_q = page == 16 ? 4 : 1;
    run_case(s);
    run_case(s, 3);
  }
}

// No query row (a grid of zero blocks once failed to launch): the new rows are still written.
TEST(KvCacheCuda, NoQueryRowStillAppends) {
  SKIP_WITHOUT_GPU();
  for (int page : {0, 16}) {
    KvShape s = decode_shape(DType::bf16);
    s.page_size = page;
    s.s_q = 0;
    s.s_new = 2;
    s.rotary_dim = s.d / 2;
    run_case(s);
  }
}

// Caches held head-major ((b, h_k, s, d) or (pages, h_k, page_size, d) memory, HF transformers'
// layout) as strided views: the append and the tiles' loads follow the head stride.
TEST(KvCacheCuda, HeadMajorCaches) {
  SKIP_WITHOUT_GPU();
  for (int page : {0, 16, 64})
    for (int s_q : {1, 5}) {
      KvShape s = decode_shape(s_q == 1 ? DType::bf16 : DType::f16);
      s.head_major = true;
      s.page_size = page;
      s.s_q = s_q;
      s.s_new = s_q;
      s.rotary_dim = s.d / 2;
      s.leftpad = page == 16;
      run_case(s);
    }
}

// Pages of 2-4 of a thread's rows per tile, gathered a page at a time (paged_kv_sm80.cuh:
// gather_pages) where a tile starts a page, per row otherwise (leftpad): 1 and 4 packed rows (the
// decode tile) and 20 (the narrow tile), head dims 64, 128 and 256.
TEST(KvCacheCuda, PagesOfSeveralRowsPerThread) {
  SKIP_WITHOUT_GPU();
  for (int d : {64, 128, 256})
    for (int page : {8, 16, 32})
      for (int s_q : {1, 5}) {
        KvShape s = decode_shape(DType::bf16);
        s.d = d;
        s.page_size = page;
        s.s_q = s_q;
        s.s_new = s_q;
        s.rotary_dim = d / 2;
        s.leftpad = s_q == 5;
        run_case(s);
      }
}

TEST(KvCacheCuda, RotaryBothStyles) {
  SKIP_WITHOUT_GPU();
  for (bool interleaved : {true, false})
    for (bool causal : {true, false}) {
      KvShape s = decode_shape(DType::bf16);
      s.rotary_dim = 64;
      s.interleaved = interleaved;
      s.causal = causal;
      s.s_q = 4;
      s.s_new = 4;
      s.page_size = 16;
      run_case(s);
    }
}

TEST(KvCacheCuda, QueryLengthsMasksScoreModsAndSplits) {
  SKIP_WITHOUT_GPU();
  for (int s_q : {1, 2, 4, 8, 16, 17}) {
    KvShape s = decode_shape(s_q % 2 ? DType::f16 : DType::bf16);
    s.s_q = s_q;
    s.s_new = s_q;
    s.page_size = s_q == 17 ? 3 : 64;
    s.rotary_dim = 128;
    s.window_left = s_q == 8 ? 100 : -1;
    s.softcap = s_q == 4 ? 20.0f : 0.0f;
    s.alibi = s_q == 16;
    run_case(s);
    run_case(s, 4);
  }
}

TEST(KvCacheCuda, HeadDimsAndGroups) {
  SKIP_WITHOUT_GPU();
  const int dims[] = {64, 128, 256};
  const int groups[][2] = {{8, 1}, {32, 8}, {4, 4}};
  for (int i = 0; i < 3; ++i) {
    KvShape s = decode_shape(DType::bf16);
    s.d = dims[i];
    s.h = groups[i][0];
    s.h_k = groups[i][1];
    s.page_size = 16;
    s.rotary_dim = dims[i] / 2;
    s.interleaved = false;
    run_case(s);
  }
}

// The split tests' problem: b 2, 16/4 heads, rotary over 64 of d, causal.
KvShape split_shape(DType dtype, int s_q, int d, int capacity) {
  KvShape s;
  s.dtype = dtype;
  s.b = 2;
  s.h = 16;
  s.h_k = 4;
  s.d = d;
  s.s_q = s_q;
  s.s_new = s_q;
  s.capacity = capacity;
  s.causal = true;
  s.rotary_dim = 64;
  return s;
}

// s with ctx.num_splits = splits on a workspace of random bytes, then a new problem of the same
// shapes on the same workspace (whatever the first call left there), its kernels sent as `launch` says.
void twice_on_random_workspace(const KvShape& s, int splits, CallLaunch launch = CallLaunch::automatic,
                               cudaStream_t stream = nullptr) {
  SCOPED_TRACE(s.str() + " splits " + std::to_string(splits));
  KvProblem pb(s);
  DeviceKv d(pb, splits);
  fill_random(*d.work);
  d.run(splits, stream, launch);
  check_results(pb, d);
  KvProblem next(s);
  d.load(next);
  d.run(splits, stream, launch);
  SCOPED_TRACE("second call");
  check_results(next, d);
}

// Forced split counts past the heuristic's (33 and 128 splits, most of the 128 without a key; 16 and
// 64 packed rows), hdim 128 and 64, paged and contiguous caches, on any workspace.
TEST(KvCacheCuda, ForcedSplitsOnAnyWorkspace) {
  SKIP_WITHOUT_GPU();
  const int cases[][4] = {{1, 33, 0, 128}, {4, 33, 16, 128}, {16, 5, 0, 64}, {4, 7, 64, 64}, {1, 128, 1, 128}};
  for (const auto& c : cases) {
    KvShape s = split_shape(c[0] == 4 ? DType::f16 : DType::bf16, c[0], c[3], 3000);
    s.page_size = c[2];
    twice_on_random_workspace(s, c[1]);
  }
}

// Split blocks that share their key tiles (fwd_split_shares_tiles: a contiguous cache, at least 32
// key tiles per split; block_range.cuh: SharedKeyTiles) on any workspace: forced 2 and 4 splits
// over 4-8k keys, full sequences and random lengths, a batch index, leftpad, a window (the second
// call finds the counters that the first call's combine set back to 0); then one CUDA graph
// replayed three times (every replay has the capture's epoch). KvCacheCudaPlan.SharedKeyTilesRule
// checks that these shapes take the shared kernel.
TEST(KvCacheCuda, SharedKeyTilesOnAnyWorkspace) {
  SKIP_WITHOUT_GPU();
  KvShape full = split_shape(DType::bf16, 1, 128, 4200);
  full.full = true;
  twice_on_random_workspace(full, 2);
  KvShape indexed = split_shape(DType::f16, 4, 64, 8300);
  indexed.batch_idx = true;
  twice_on_random_workspace(indexed, 4);
  KvShape windowed = split_shape(DType::bf16, 3, 128, 4200);
  windowed.causal = false;
  windowed.window_left = 3000;
  windowed.leftpad = true;
  twice_on_random_workspace(windowed, 2);
  capture_and_replay(full, 2);
}

// Appended rows across a 64-key tile boundary: new keys in two tiles, read by one block (1 and 3
// fixed splits) or by two (8 fixed splits, the heuristic's ~1 tile per split on a 132-SM device,
// and shared key tiles, whose first positions are fixed per split). Appends over pages of 1, 3 and
// 16 rows with 12 packed rows (the decode tile), and left windows that see all of 4 new rows or
// only some. The cache bytes after the append are checked against the CPU's (check_results).
TEST(KvCacheCuda, AppendsAcrossKeyTiles) {
  SKIP_WITHOUT_GPU();
  for (int splits : {0, 1, 3, 8}) {
    KvShape s = split_shape(DType::bf16, 4, 128, 3000);  // 16 packed rows: the decode tile
    s.held = 64 * 20 + 62;                              // new keys 1342-1345: tiles 20 and 21
    s.interleaved = splits % 2 == 0;
    twice_on_random_workspace(s, splits);
  }
  KvShape shared = split_shape(DType::f16, 4, 64, 8300);  // shared key tiles at 4 splits
  shared.held = 64 * 100 + 63;
  shared.batch_idx = true;
  twice_on_random_workspace(shared, 4);
  for (int page : {1, 3, 16}) {
    KvShape s = decode_shape(DType::bf16);
    s.page_size = page;
    s.s_q = s.s_new = 3;
    s.rotary_dim = 64;
    s.interleaved = page != 3;
    s.leftpad = page == 3;
    run_case(s);
    run_case(s, 5);
  }
  for (int window_left : {1, 3}) {
    KvShape s = decode_shape(DType::bf16);
    s.s_q = s.s_new = 4;
    s.rotary_dim = 128;
    s.window_left = window_left;
    run_case(s);
    run_case(s, 3);
  }
}

// Context::call_launch: a call's kernels one by one and as the cached graph (launch_batch.hpp), on
// the same kinds of call: an append with rotary over pages of 16 (three kernels: append, forward,
// combine), no append with 4 forced splits (two), unsplit (one, never a graph), shared key tiles.
// Each call twice on one workspace (the graph's second launch gets new arguments), for two batch
// sizes (the cached graph with other grids), on the legacy stream and on a stream of its own (a
// graph of its own).
TEST(KvCacheCuda, LaunchModesAgree) {
  SKIP_WITHOUT_GPU();
  cudaStream_t own;
  cuda_ok(cudaStreamCreateWithFlags(&own, cudaStreamNonBlocking));
  for (CallLaunch launch : {CallLaunch::kernels, CallLaunch::graph})
    for (cudaStream_t stream : {cudaStream_t{nullptr}, own})
      for (int b : {3, 5}) {
        SCOPED_TRACE(std::string(launch == CallLaunch::graph ? "graph" : "kernels") +
                     (stream == nullptr ? ", legacy stream" : ", own stream"));
        KvShape paged = decode_shape(DType::bf16);
        paged.b = b;
        paged.page_size = 16;
        paged.rotary_dim = 128;
        twice_on_random_workspace(paged, 0, launch, stream);
        KvShape plain = decode_shape(DType::f16);
        plain.b = b;
        plain.s_new = 0;
        twice_on_random_workspace(plain, 4, launch, stream);
        twice_on_random_workspace(plain, 1, launch, stream);
      }
  KvShape shared = split_shape(DType::bf16, 1, 128, 4200);
  shared.full = true;
  for (CallLaunch launch : {CallLaunch::kernels, CallLaunch::graph}) twice_on_random_workspace(shared, 2, launch, own);
  cuda_ok(cudaStreamDestroy(own));
}

// Two problems of one shape, so one cached graph, called in turns on one stream: A, A, B, A, B, B.
// A call whose arguments repeat the graph's last ones skips setting them (launch_batch.cu), so every
// call here is checked, each with fresh values in the same buffers: a node left with the other
// problem's pointers, grid or length would read or write the wrong tensors.
TEST(KvCacheCuda, GraphNodesFollowEachCallsArguments) {
  SKIP_WITHOUT_GPU();
  cudaStream_t own;
  cuda_ok(cudaStreamCreateWithFlags(&own, cudaStreamNonBlocking));
  for (int splits : {0, 3}) {
    KvShape s = decode_shape(DType::bf16);
    s.page_size = 16;
    s.rotary_dim = 128;
    SCOPED_TRACE(s.str() + " splits " + std::to_string(splits));
    KvProblem first_a(s), first_b(s);
    DeviceKv a(first_a, splits), b(first_b, splits);
    int call = 0;
    for (DeviceKv* d : {&a, &a, &b, &a, &b, &b}) {
      SCOPED_TRACE("call " + std::to_string(call++) + (d == &a ? " (A)" : " (B)"));
      KvProblem next(s);
      d->load(next);
      d->run(splits, own, CallLaunch::graph);
      check_results(next, *d);
    }
  }
  cuda_ok(cudaStreamDestroy(own));
}

// Two host threads calling on one stream, each on its own buffers, so both use one cached graph
// (launch_batch.cu sets a node's arguments and launches under the cache's lock): every call's
// results are its own problem's.
TEST(KvCacheCuda, GraphCallsFromTwoThreadsOnOneStream) {
  SKIP_WITHOUT_GPU();
  cudaStream_t shared;
  cuda_ok(cudaStreamCreateWithFlags(&shared, cudaStreamNonBlocking));
  KvShape s = decode_shape(DType::bf16);
  s.page_size = 16;
  s.rotary_dim = 128;
  constexpr int kCalls = 6;
  std::vector<std::unique_ptr<KvProblem>> problems;  // drawn here: the tests' generator is not shared
  for (int i = 0; i < 2 * (kCalls + 1); ++i) problems.push_back(std::make_unique<KvProblem>(s));
  auto calls = [&](int thread) {
    SCOPED_TRACE("thread " + std::to_string(thread));
    auto mine = [&](int call) -> const KvProblem& { return *problems[thread * (kCalls + 1) + call]; };
    DeviceKv d(mine(0), 3);
    for (int call = 1; call <= kCalls; ++call) {
      SCOPED_TRACE("call " + std::to_string(call));
      d.load(mine(call));
      cuda_ok(cudaStreamSynchronize(nullptr));  // the legacy stream's copies, before the other stream reads them
      d.run(3, shared, CallLaunch::graph);
      check_results(mine(call), d);  // synchronises the device first
    }
  };
  std::thread other(calls, 1);
  calls(0);
  other.join();
  cuda_ok(cudaStreamDestroy(shared));
}

// A call's first graph (built and instantiated on that call) while this thread captures another
// stream in global mode, as torch.cuda.graph does: the build must neither fail nor end that capture.
// The cache of graphs is full first (graphs on 40 streams; it keeps 32), so the build also evicts
// one (cudaGraphExecDestroy under the capture failed it once the cache had filled in this process).
TEST(KvCacheCuda, GraphBuiltDuringAnotherCapture) {
  SKIP_WITHOUT_GPU();
  cudaStream_t captured, own;
  cuda_ok(cudaStreamCreateWithFlags(&captured, cudaStreamNonBlocking));
  cuda_ok(cudaStreamCreateWithFlags(&own, cudaStreamNonBlocking));
  KvShape s = decode_shape(DType::bf16);
  s.page_size = 16;
  s.rotary_dim = 128;
  KvProblem pb(s);
  DeviceKv d(pb, 0);
  for (int i = 0; i < 40; ++i) {
    cudaStream_t filler;
    cuda_ok(cudaStreamCreateWithFlags(&filler, cudaStreamNonBlocking));
    d.run(0, filler, CallLaunch::graph);
    cuda_ok(cudaStreamSynchronize(filler));
    cuda_ok(cudaStreamDestroy(filler));
  }
  d.load(pb);  // the cache as the problem holds it, before the checked call
  cuda_ok(cudaStreamBeginCapture(captured, cudaStreamCaptureModeGlobal));
  d.run(0, own, CallLaunch::graph);
  cudaGraph_t graph = nullptr;
  cuda_ok(cudaStreamEndCapture(captured, &graph));
  cuda_ok(cudaGraphDestroy(graph));
  check_results(pb, d);
  cuda_ok(cudaStreamDestroy(captured));
  cuda_ok(cudaStreamDestroy(own));
}

// Options::deterministic: a shape whose splits would share key tiles runs the fixed splits instead
// (KvCacheCudaPlan.SharedKeyTilesRule), so repeated calls on one workspace give the same bits; the
// first is checked against the reference.
TEST(KvCacheCuda, DeterministicRepeatsBitForBit) {
  SKIP_WITHOUT_GPU();
  KvShape s = split_shape(DType::bf16, 1, 128, 8300);
  s.full = true;
  KvProblem pb(s);
  DeviceKv d(pb, 4);
  d.opt.deterministic = true;
  fill_random(*d.work);
  d.run(4);
  check_results(pb, d);
  HostTensor out0 = pb.new_out(), lse0 = pb.new_lse();
  d.out.copy_to(out0);
  d.lse.copy_to(lse0);
  for (int repeat = 0; repeat < 3; ++repeat) {
    d.out.copy_from(pb.new_out());  // poisoned again
    d.lse.copy_from(pb.new_lse());
    d.run(4);
    cuda_ok(cudaDeviceSynchronize());
    HostTensor out = pb.new_out(), lse = pb.new_lse();
    d.out.copy_to(out);
    d.lse.copy_to(lse);
    EXPECT_TRUE(same_bytes(out, out0)) << "out of repeat " << repeat;
    EXPECT_TRUE(same_bytes(lse, lse0)) << "lse of repeat " << repeat;
  }
}

// The host plan tests' call: b = 1 decoding, GQA 32/8, hdim 128 bf16 (the narrow tile's 64-key tiles).
flashmonoid::detail::FwdParams decode_params(int seqlen_k) {
  flashmonoid::detail::FwdParams p;
  p.dtype = DType::bf16;
  p.batch = 1;
  p.h = 32;
  p.h_k = 8;
  p.d = 128;
  p.seqlen_q = 1;
  p.total_q = 1;
  p.seqlen_k = seqlen_k;
  p.kv.active = true;
  return p;
}

// Which split calls share key tiles: a host rule (fwd_split_shares_tiles), so this runs without a
// GPU.
TEST(KvCacheCudaPlan, SharedKeyTilesRule) {
  using flashmonoid::cuda::fwd_split_shares_tiles;
  const flashmonoid::detail::FwdParams p = decode_params(131072);  // 2048 key tiles
  EXPECT_TRUE(fwd_split_shares_tiles(p, 33));  // 62 tiles per split
  EXPECT_TRUE(fwd_split_shares_tiles(p, 64));  // 32
  EXPECT_FALSE(fwd_split_shares_tiles(p, 65));
  EXPECT_FALSE(fwd_split_shares_tiles(p, 1));  // unsplit
  auto with = [&](auto change) {
    flashmonoid::detail::FwdParams q = p;
    change(q);
    return fwd_split_shares_tiles(q, 33);
  };
  EXPECT_FALSE(with([](auto& q) { q.seqlen_k = 32768; }));  // 16 tiles per split
  EXPECT_FALSE(with([](auto& q) { q.deterministic = true; }));
  EXPECT_FALSE(with([](auto& q) { q.softcap = 30.0f; }));  // score modifiers: no shared variant
  EXPECT_FALSE(with([](auto& q) { q.d = 256; }));
  static const int table[1] = {0};
  EXPECT_FALSE(with([](auto& q) {  // paged
    q.kv.block_table = table;
    q.kv.page_size = 16;
  }));
  EXPECT_TRUE(with([](auto& q) { q.d = 64; }));
  // split_shape's calls (b 2, 16/4 heads) with s_q, d and capacity keys.
  auto split_call = [&](int s_q, int d, int capacity) {
    flashmonoid::detail::FwdParams q = p;
    q.batch = 2;
    q.h = 16;
    q.h_k = 4;
    q.seqlen_q = s_q;
    q.total_q = 2 * s_q;
    q.d = d;
    q.seqlen_k = capacity;
    return q;
  };
  // SharedKeyTilesOnAnyWorkspace's shapes do share, so that test runs the shared kernel:
  // (s_q, d, capacity, splits).
  for (auto [s_q, d, capacity, splits] : {std::array{1, 128, 4200, 2}, {4, 64, 8300, 4}, {3, 128, 4200, 2}})
    EXPECT_TRUE(fwd_split_shares_tiles(split_call(s_q, d, capacity), splits))
        << "s_q " << s_q << " d " << d << " capacity " << capacity;
  // DeterministicRepeatsBitForBit's shape would share, but not under Options::deterministic.
  flashmonoid::detail::FwdParams repeated = split_call(1, 128, 8300);
  EXPECT_TRUE(fwd_split_shares_tiles(repeated, 4));
  repeated.deterministic = true;
  EXPECT_FALSE(fwd_split_shares_tiles(repeated, 4));
}

// How many splits decoding gets on an H100 (132 SMs, 228 KB per SM): one wave of two blocks per SM,
// at least one key tile per split for packed decoding rows, four for a full 64-row block. A host
// rule (fwd_choose_num_splits), so this runs without a GPU.
TEST(KvCacheCudaPlan, SplitsFillTheResidentBlocks) {
  using flashmonoid::cuda::fwd_choose_num_splits;
  const flashmonoid::detail::FwdParams p = decode_params(0);
  auto splits = [&](int s_q, int s_k, int batch = 1) {
    flashmonoid::detail::FwdParams q = p;
    q.seqlen_q = s_q;
    q.total_q = batch * s_q;
    q.batch = batch;
    q.seqlen_k = s_k;
    return fwd_choose_num_splits(q, 132, 233472);
  };
  EXPECT_EQ(splits(1, 1024), 16);   // 16 key tiles of 64: one each
  EXPECT_EQ(splits(1, 2048), 32);
  EXPECT_EQ(splits(1, 4096), 33);   // 2 · 132 / 8 blocks
  EXPECT_EQ(splits(1, 32768), 33);
  EXPECT_EQ(splits(4, 1024), 16);   // 16 packed rows
  EXPECT_EQ(splits(16, 1024), 4);   // 64 packed rows: a full block, 4 tiles per split
  EXPECT_EQ(splits(1, 4096, 8), 4); // 64 blocks: 2 · 132 / 64
  EXPECT_EQ(splits(1, 128), 2);
  EXPECT_EQ(splits(1, 64), 1);      // one key tile: no split
}

// Which tile a call takes (plan_fwd_sm80, host only): the decode tile (its warps split each key
// tile) for at most 16 packed rows at hdim <= 128 without dropout, the narrow tile for other
// decoding and short calls.
TEST(KvCacheCudaPlan, DecodeTileForFewPackedRows) {
  using flashmonoid::cuda::FwdTileKind;
  using flashmonoid::cuda::plan_fwd_sm80;
  const flashmonoid::detail::FwdParams p = decode_params(4096);
  auto kind = [&](auto change) {
    flashmonoid::detail::FwdParams q = p;
    change(q);
    return plan_fwd_sm80(q, 233472).kind;
  };
  EXPECT_EQ(kind([](auto&) {}), FwdTileKind::decode);                        // 4 packed rows
  EXPECT_EQ(kind([](auto& q) { q.seqlen_q = 4; }), FwdTileKind::decode);     // 16
  EXPECT_EQ(kind([](auto& q) { q.seqlen_q = 5; }), FwdTileKind::narrow);     // 20
  EXPECT_EQ(kind([](auto& q) { q.d = 64; }), FwdTileKind::decode);
  EXPECT_EQ(kind([](auto& q) { q.d = 256; }), FwdTileKind::narrow);
  EXPECT_EQ(kind([](auto& q) { q.dropout_p = 0.1f; }), FwdTileKind::narrow);
  EXPECT_EQ(kind([](auto& q) { q.softcap = 30.0f; }), FwdTileKind::decode);   // score modifiers run on it
  EXPECT_EQ(kind([](auto& q) { q.kv.active = false; }), FwdTileKind::decode); // a plain forward of 4 rows
  EXPECT_EQ(kind([](auto& q) { q.h_k = 32; }), FwdTileKind::decode);          // MHA: 1 row per head
  EXPECT_EQ(kind([](auto& q) { q.h_k = 32; q.seqlen_q = 17; }), FwdTileKind::narrow);
  const flashmonoid::cuda::FwdPlanSm80 plan = plan_fwd_sm80(p, 233472);
  EXPECT_EQ(plan.tile.block_m, 16);
  EXPECT_EQ(plan.num_m_blocks, 1);
  EXPECT_TRUE(plan.tile.warps_on_keys);
}

// cache_seqlens as one host int (every sequence holds the same rows), and calls without new rows
// (attention over the cache alone), contiguous and paged.
TEST(KvCacheCuda, HostSeqlenAndNoAppend) {
  SKIP_WITHOUT_GPU();
  for (int page : {0, 16}) {
    KvShape s = decode_shape(DType::bf16);
    s.page_size = page;
    s.s_q = 3;
    s.s_new = 3;
    s.seqlens_tensor = false;
    s.rotary_dim = 64;  // positions from the host int
    run_case(s);
    s.s_new = 0;
    s.rotary_dim = 0;
    run_case(s);
    run_case(s, 4);
    s.seqlens_tensor = true;
    s.leftpad = true;
    s.batch_idx = page == 0;
    s.causal = false;
    run_case(s);
  }
}

// One capture, replays with new seqlens, block tables and data (capture_and_replay).
TEST(KvCacheCuda, GraphCaptureAndReplay) {
  SKIP_WITHOUT_GPU();
  KvShape s = decode_shape(DType::bf16);
  s.page_size = 16;
  s.rotary_dim = 128;
  s.s_new = 1;
  s.leftpad = true;
  capture_and_replay(s, 0);
}

// dst[i] = src[i] for i < n (two arrays), after ~ns of spinning: a kernel that writes a decoding
// call's lengths and page table late, just before the call, as an engine's step preparation may.
__global__ void copy_late(int* dst_a, const int* src_a, int n_a, int* dst_b, const int* src_b, int n_b,
                          unsigned long long ns) {
  // Lets the next kernel launch at once, as a kernel that knows programmatic launches may (the last
  // kernel of a decoding call does): the call's own waits must still order every read after it.
  flashmonoid::cuda::pdl_launch_dependents();
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    __nanosleep(1000);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < ns);
  for (int i = static_cast<int>(threadIdx.x); i < n_a; i += static_cast<int>(blockDim.x)) dst_a[i] = src_a[i];
  for (int i = static_cast<int>(threadIdx.x); i < n_b; i += static_cast<int>(blockDim.x)) dst_b[i] = src_b[i];
}

// The call's first kernel launches under the kernel before it (pdl.cuh): nothing it or the forward
// reads may come from before that kernel ends. cache_seqlens and the block table hold another
// problem's values until a kernel just before the call (copy_late, 50 us late) writes this one's.
// Each case runs 6 times: with the append's trigger placed before its wait (a race: the forward
// reads the lengths and the table before its own wait) one pass failed 1 run of 3, six passes
// failed 3 of 3 (16-20 cases each, H100), and the fixed code passed 3 of 3. Each case runs with the
// kernels launched one by one (where the race lives) and as the cached graph (Context::call_launch).
TEST(KvCacheCuda, InputsWrittenByTheKernelBefore) {
  SKIP_WITHOUT_GPU();
  for (int round = 0; round < 6; ++round)
    for (int page : {0, 16})
      for (int s_new : {1, 0})
        for (CallLaunch launch : {CallLaunch::kernels, CallLaunch::graph}) {
          KvShape s = decode_shape(DType::bf16);
          s.page_size = page;
          s.s_new = s_new;
          s.rotary_dim = s_new > 0 ? 128 : 0;
          SCOPED_TRACE(s.str() + (launch == CallLaunch::graph ? " graph" : " kernels"));
          KvProblem stale(s), pb(s);
          DeviceKv d(stale, 0);
          d.load(pb);
          d.seqlens.copy_from(stale.seqlens);
          if (page > 0) d.block_table.copy_from(stale.block_table);
          DeviceTensor seqlens(pb.seqlens), table(pb.block_table);
          cudaStream_t stream;
          cuda_ok(cudaStreamCreate(&stream));
          copy_late<<<1, 128, 0, stream>>>(static_cast<int*>(d.seqlens.ptr), static_cast<const int*>(seqlens.ptr),
                                           s.b, page > 0 ? static_cast<int*>(d.block_table.ptr) : nullptr,
                                           static_cast<const int*>(table.ptr),
                                           page > 0 ? static_cast<int>(table.bytes / sizeof(int)) : 0, 50000);
          cuda_ok(cudaGetLastError());
          d.run(0, stream, launch);
          check_results(pb, d);
          cuda_ok(cudaStreamDestroy(stream));
        }
}

// Values only the device sees, out of range: the kernels clamp them (kvcache.hpp) and must not
// fault. The result is unspecified; memcheck (tools/device_run.sh) proves no access goes astray.
TEST(KvCacheCuda, DeviceOnlyValuesOutOfRangeAreClamped) {
  SKIP_WITHOUT_GPU();
  for (int page : {0, 16}) {
    KvShape s = decode_shape(DType::bf16);
    s.page_size = page;
    s.batch_idx = page == 0;
    s.leftpad = true;
    s.s_new = 2;
    s.rotary_dim = 64;
    KvProblem pb(s);
    DeviceKv d(pb, 3);  // workspace for 3 splits: the split path runs on the clamped values too
    HostTensor bad_lens = pb.seqlens, bad_lp = pb.leftpad, bad_table = pb.block_table, bad_idx = pb.batch_idx;
    const int lens[] = {1 << 30, -7, pb.capacity};
    std::memcpy(bad_lens.buf.data(), lens, sizeof(lens));  // (a copy's view still points at the original)
    const int lp[] = {-3, 1 << 29, 1 << 29};
    std::memcpy(bad_lp.buf.data(), lp, sizeof(lp));
    d.seqlens.copy_from(bad_lens);
    d.leftpad.copy_from(bad_lp);
    if (page) {
      std::vector<int> t(bad_table.buf.size() / sizeof(int));
      for (std::size_t i = 0; i < t.size(); ++i) t[i] = i % 2 ? -5 : pb.num_pages + static_cast<int>(i);
      std::memcpy(bad_table.buf.data(), t.data(), bad_table.buf.size());
      d.block_table.copy_from(bad_table);
    } else {
      const int idx[] = {-1, 1 << 30, 2};
      std::memcpy(bad_idx.buf.data(), idx, sizeof(idx));
      d.batch_idx.copy_from(bad_idx);
    }
    d.run(0);
    cuda_ok(cudaDeviceSynchronize());
    d.run(3);
    cuda_ok(cudaDeviceSynchronize());
  }
}

TEST(KvCacheCuda, HostRulesStillApply) {
  SKIP_WITHOUT_GPU();
  KvShape s = decode_shape(DType::bf16);
  s.rotary_dim = 64;
  KvProblem pb(s);
  DeviceKv d(pb, 0);
  Context ctx;  // rotary needs the rotated q's workspace
  expect_error([&] { flashmonoid::forward_kvcache(d.q.view, d.cache, d.k_new.view, d.v_new.view, d.rotary, d.out.view,
                                                  d.lse.view, d.opt, ctx); },
               "ctx.workspace", "bytes of device workspace for the rotated q");
}

}  // namespace
}  // namespace fmtest
