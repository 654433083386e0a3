// Driver of the CPU emulation of the CUDA FLOATER kernels (cuda_emulation.h):
//   emulate_floater IN OUT      the forward (with its tape) and the backward, in the layout
//                               given in IN
//   emulate_floater --layout S d H L n method dtype_size backward [need_t [a100]]
//                               print the layout choose_layout() picks for an H100-like device
//                               (a100: an A100-like one, without clusters)
// IN: one line "S d H L n method act dtype_size mode C Sg layout need0..need5 tape chunk"
// (layout: bit 0 weights resident in shared memory, bit 1 exchanged vectors read from L2
// (grid), bit 2 half of the weight rows resident; tape: intervals the forward keeps (the
// backward reads them instead of integrating them again); chunk: the backward's intervals
// per chunk, 0 automatic), then float64 arrays p0, w1, b1, w2, b2, times, grad (raw,
// native endianness).
// OUT: float64 arrays out, dp0, dw1, db1, dw2, db2, dtimes (zeros where not needed), then
// the tape (its stage values, the CPU tape's layout).
// The weight gradients' GEMMs (GradSink: ATen on a GPU) are loops here, in the same order.
// Built with cuda_emulation.h force-included (-include) and include/ before the system's
// headers: tests/floater/test_extension_cuda_emulation.py has the command.
#include "floater/floater_cuda.cu"

#include <fstream>
#include <iostream>
#include <string>

using namespace posenc_fast::floater;
using namespace posenc_fast::floater::cuda;

template <typename T>
std::vector<T> convert(const std::vector<double>& v) {
  return std::vector<T>(v.begin(), v.end());
}

// dw[:K] += X^T G (X through the activation for layer 2), dw[K] += taus^T (G summed over
// the states of each stage), db += G summed over rows.
template <typename T>
struct LoopSink : GradSink {
  T *dw1, *db1, *dw2, *db2;
  long S;
  int act;
  cudaError_t layer(int layer, const void* Xv, const void* Gv, const void* tv, int64_t stages, int64_t K,
                    int64_t N) override {
    const T* X = static_cast<const T*>(Xv);
    const T* G = static_cast<const T*>(Gv);
    const T* taus = static_cast<const T*>(tv);
    T* dw = layer == 1 ? dw1 : dw2;
    T* db = layer == 1 ? db1 : db2;
    const long R = stages * S;
    if (dw) {
      for (long k = 0; k < K; ++k)
        for (long n = 0; n < N; ++n) {
          T acc = T(0);
          for (long r = 0; r < R; ++r) {
            const T x = layer == 1 ? X[r * K + k] : act_fwd(act, X[r * K + k]);
            acc += x * G[r * N + n];
          }
          dw[k * N + n] += acc;
        }
    }
    for (long n = 0; n < N; ++n) {
      T vt = T(0), vb = T(0);
      for (long q = 0; q < stages; ++q) {
        T g = T(0);
        for (long m = 0; m < S; ++m) g += G[(q * S + m) * N + n];
        vt += taus[q] * g;
        vb += g;
      }
      if (dw) dw[K * N + n] += vt;
      if (db) db[n] += vb;
    }
    return cudaSuccess;
  }
};

template <typename T>
int run(const Problem& fwd, int mode, int C, int Sg, int layout, long tape_intervals,
        std::vector<std::vector<double>>& in, std::vector<std::vector<double>>& res) {
  std::vector<std::vector<T>> t;
  for (auto& a : in) t.push_back(convert<T>(a));
  const long S = fwd.S, d = fwd.d, H = fwd.H, L = fwd.L;
  const double resident = layout & 4 ? 0.5 : (layout & 1 ? 1.0 : 0.0);
  const bool staged = !(layout & 2);
  std::vector<T> out(S * L * d, T(-12345));  // poisoned
  Layout pl{};
  if (layout_for(fwd, mode, C, Sg, resident, &pl, staged) != cudaSuccess) {
    std::cerr << "layout_for failed\n";
    return 2;
  }
  std::vector<unsigned char> ws(forward_workspace_bytes(fwd, pl) + 16, 0);
  const long tape_n = tape_numel(S, d, H, tape_intervals, fwd.substeps, fwd.method);
  std::vector<T> tape(tape_n, T(-54321));
  Pointers p{};
  p.p0 = t[0].data();
  p.w1 = t[1].data();
  p.b1 = t[2].data();
  p.w2 = t[3].data();
  p.b2 = t[4].data();
  p.times = t[5].data();
  p.out = out.data();
  p.workspace = ws.data();
  const TapeRef tr{tape_n ? tape.data() : nullptr, tape_intervals};
  if (forward(fwd, pl, p, tr, nullptr) != cudaSuccess) return 3;
  Problem bwd = fwd;
  bwd.backward = true;
  Layout pb{};
  if (layout_for(bwd, mode, C, Sg, resident, &pb, staged) != cudaSuccess) return 4;
  std::vector<unsigned char> wsb(backward_workspace_bytes(bwd, pl, pb, tr) + 16, 0xff);  // garbage
  const long sizes[6] = {S * d, (d + 1) * H, H, (H + 1) * d, d, L};
  std::vector<std::vector<T>> g(6);
  void** outs[6] = {&p.dp0, &p.dw1, &p.db1, &p.dw2, &p.db2, &p.dtimes};
  for (int i = 0; i < 6; ++i) {
    g[i].assign(sizes[i], T(0));
    *outs[i] = bwd.needs[i] ? g[i].data() : nullptr;
  }
  p.grad = t[6].data();
  p.out_saved = out.data();
  p.workspace = wsb.data();
  LoopSink<T> sink;
  sink.dw1 = static_cast<T*>(p.dw1);
  sink.db1 = static_cast<T*>(p.db1);
  sink.dw2 = static_cast<T*>(p.dw2);
  sink.db2 = static_cast<T*>(p.db2);
  sink.S = S;
  sink.act = fwd.activation;
  if (backward(bwd, pl, pb, p, tr, sink, nullptr) != cudaSuccess) return 5;
  res.clear();
  res.emplace_back(out.begin(), out.end());
  for (int i = 0; i < 6; ++i) res.emplace_back(g[i].begin(), g[i].end());
  res.emplace_back(tape.begin(), tape.end());
  std::cerr << "fwd layout: " << pl.why << "\nbwd layout: " << pb.why << "\n";
  return 0;
}

int main(int argc, char** argv) {
  if (argc >= 2 && std::string(argv[1]) == "--layout") {
    if (argc < 10) return 1;
    Problem pr{};
    pr.S = std::atol(argv[2]);
    pr.d = std::atol(argv[3]);
    pr.H = std::atol(argv[4]);
    pr.L = std::atol(argv[5]);
    pr.substeps = std::atol(argv[6]);
    pr.method = std::atoi(argv[7]);
    pr.dtype_size = std::atoi(argv[8]);
    pr.backward = std::atoi(argv[9]) != 0;
    pr.needs[5] = argc > 10 && std::atoi(argv[10]) != 0;
    if (argc > 11 && std::string(argv[11]) == "a100") setenv("POSENC_FAST_EMU_DEVICE", "a100", 1);
    Layout pl{};
    const cudaError_t e = choose_layout(pr, 0, &pl);
    if (e != cudaSuccess) {
      std::cout << "error " << e << "\n";
      return 1;
    }
    std::cout << pl.mode << " " << pl.C << " " << pl.G << " " << pl.Sg << " " << pl.kr1 << " " << pl.kr2 << " "
              << pl.smem_bytes << " " << pl.workspace_bytes << "\n"
              << pl.why << "\n";
    return 0;
  }
  if (argc != 3) {
    std::cerr << "usage: emulate_floater IN OUT | --layout S d H L n method dtype_size backward [need_t [a100]]\n";
    return 1;
  }
  std::ifstream f(argv[1], std::ios::binary);
  Problem pr{};
  int mode, C, Sg, layout, need[6];
  long tape_intervals = 0;
  f >> pr.S >> pr.d >> pr.H >> pr.L >> pr.substeps >> pr.method >> pr.activation >> pr.dtype_size >> mode >> C >>
      Sg >> layout;
  for (int i = 0; i < 6; ++i) {
    f >> need[i];
    pr.needs[i] = need[i] != 0;
  }
  f >> tape_intervals >> pr.chunk_intervals;
  f.get();  // the newline
  const long S = pr.S, d = pr.d, H = pr.H, L = pr.L;
  const long sizes[7] = {S * d, (d + 1) * H, H, (H + 1) * d, d, L, S * L * d};
  std::vector<std::vector<double>> in(7);
  for (int i = 0; i < 7; ++i) {
    in[i].resize(sizes[i]);
    f.read(reinterpret_cast<char*>(in[i].data()), sizes[i] * sizeof(double));
  }
  if (!f) {
    std::cerr << "short input\n";
    return 1;
  }
  std::vector<std::vector<double>> res;
  const int rc = pr.dtype_size == 4 ? run<float>(pr, mode, C, Sg, layout, tape_intervals, in, res)
                                    : run<double>(pr, mode, C, Sg, layout, tape_intervals, in, res);
  if (rc) return rc;
  std::ofstream o(argv[2], std::ios::binary);
  for (auto& a : res) o.write(reinterpret_cast<const char*>(a.data()), a.size() * sizeof(double));
  return 0;
}
