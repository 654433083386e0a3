// Driver of the CPU emulation of the CUDA FLOATER kernels (cuda_emulation.h):
//   emulate_floater IN OUT      run forward + backward with the layout given in IN
//   emulate_floater --plan S d H L n method dtype_size backward
//                               print the layout plan() picks for an H100-like device
// IN: one line "S d H L n method act dtype_size mode C Sg layout need0..need5" (layout:
// bit 0 weights resident in shared memory, bit 1 exchanged vectors read from L2), then
// float64 arrays p0, w1, b1, w2, b2, times, grad (raw, native endianness).
// OUT: float64 arrays out, dp0, dw1, db1, dw2, db2, dtimes (zeros where not needed).
#define POSENC_FAST_CUDA_EMULATION 1
#include "floater/floater_cuda.cu"

#include <fstream>
#include <iostream>
#include <string>

using namespace posenc_fast::floater::cuda;

template <typename T>
std::vector<T> convert(const std::vector<double>& v) {
  return std::vector<T>(v.begin(), v.end());
}

template <typename T>
int run(const Problem& fwd, int mode, int C, int Sg, int layout, std::vector<std::vector<double>>& in,
        std::vector<std::vector<double>>& res) {
  std::vector<std::vector<T>> t;
  for (auto& a : in) t.push_back(convert<T>(a));
  const long S = fwd.S, d = fwd.d, H = fwd.H, L = fwd.L;
  std::vector<T> out(S * L * d, T(-12345));  // poisoned
  Plan pl{};
  if (plan_with(fwd, mode, C, Sg, layout & 1, &pl, !(layout & 2)) != cudaSuccess) {
    std::cerr << "plan_with failed\n";
    return 2;
  }
  std::vector<unsigned char> ws(pl.workspace_bytes, 0);
  Pointers p{};
  p.p0 = t[0].data();
  p.w1 = t[1].data();
  p.b1 = t[2].data();
  p.w2 = t[3].data();
  p.b2 = t[4].data();
  p.times = t[5].data();
  p.out = out.data();
  p.workspace = ws.data();
  if (launch(fwd, pl, p, nullptr) != cudaSuccess) return 3;
  Problem bwd = fwd;
  bwd.backward = true;
  Plan pb{};
  if (plan_with(bwd, mode, C, Sg, layout & 1, &pb, !(layout & 2)) != cudaSuccess) return 4;
  std::vector<unsigned char> wsb(pb.workspace_bytes, 0);
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
  if (launch(bwd, pb, p, nullptr) != cudaSuccess) return 5;
  res.clear();
  res.emplace_back(out.begin(), out.end());
  for (int i = 0; i < 6; ++i) res.emplace_back(g[i].begin(), g[i].end());
  std::cerr << "fwd plan: " << pl.why << "\nbwd plan: " << pb.why << "\n";
  return 0;
}

int main(int argc, char** argv) {
  if (argc >= 2 && std::string(argv[1]) == "--plan") {
    Problem pr{};
    pr.S = std::atol(argv[2]);
    pr.d = std::atol(argv[3]);
    pr.H = std::atol(argv[4]);
    pr.L = std::atol(argv[5]);
    pr.substeps = std::atol(argv[6]);
    pr.method = std::atoi(argv[7]);
    pr.dtype_size = std::atoi(argv[8]);
    pr.backward = std::atoi(argv[9]) != 0;
    Plan pl{};
    const cudaError_t e = plan(pr, 0, &pl);
    if (e != cudaSuccess) {
      std::cout << "error " << e << "\n";
      return 1;
    }
    std::cout << pl.mode << " " << pl.C << " " << pl.G << " " << pl.Sg << " " << pl.resident << " "
              << pl.smem_bytes << " " << pl.workspace_bytes << "\n"
              << pl.why << "\n";
    return 0;
  }
  if (argc != 3) {
    std::cerr << "usage: emulate_floater IN OUT | --plan S d H L n method dtype_size backward\n";
    return 1;
  }
  std::ifstream f(argv[1], std::ios::binary);
  Problem pr{};
  int mode, C, Sg, resident, need[6];
  f >> pr.S >> pr.d >> pr.H >> pr.L >> pr.substeps >> pr.method >> pr.activation >> pr.dtype_size >> mode >> C >>
      Sg >> resident;
  for (int i = 0; i < 6; ++i) {
    f >> need[i];
    pr.needs[i] = need[i] != 0;
  }
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
  const int rc = pr.dtype_size == 4 ? run<float>(pr, mode, C, Sg, resident, in, res)
                                    : run<double>(pr, mode, C, Sg, resident, in, res);
  if (rc) return rc;
  std::ofstream o(argv[2], std::ios::binary);
  for (auto& a : res) o.write(reinterpret_cast<const char*>(a.data()), a.size() * sizeof(double));
  return 0;
}
