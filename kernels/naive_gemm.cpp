// Example C++ kernel for the linear op: a naive i-k-j triple-loop GEMM in float32.
// peat compiles it with torch.utils.cpp_extension on first use and caches the build by the
// hash of this file. It exports the kernel contract for "linear":
//   forward(x, weight, bias), input_grad(grad_out, weight), weight_grad(grad_out, x)
#include <torch/extension.h>

namespace {

// out[M,N] = a[M,K] @ b[K,N], accumulating over k in order, one row of out at a time.
torch::Tensor gemm(const torch::Tensor& a_in, const torch::Tensor& b_in) {
  // A CPU kernel reading a GPU tensor's memory as host memory segfaults; on a GPU vendor that
  // ends the playback job (its first calls run in the job's process there) instead of a crash.
  TORCH_CHECK(a_in.device().is_cpu() && b_in.device().is_cpu(), "naive_gemm: a CPU kernel, given tensors on ",
              a_in.device(), " and ", b_in.device());
  TORCH_CHECK(a_in.dim() == 2 && b_in.dim() == 2 && a_in.size(1) == b_in.size(0),
              "naive_gemm: shapes ", a_in.sizes(), " and ", b_in.sizes(), " do not multiply");
  auto a = a_in.to(torch::kFloat32).contiguous();
  auto b = b_in.to(torch::kFloat32).contiguous();
  const int64_t m = a.size(0), k = a.size(1), n = b.size(1);
  auto out = torch::zeros({m, n}, a.options());
  const float* pa = a.data_ptr<float>();
  const float* pb = b.data_ptr<float>();
  float* po = out.data_ptr<float>();
  for (int64_t i = 0; i < m; ++i)
    for (int64_t kk = 0; kk < k; ++kk) {
      const float aik = pa[i * k + kk];
      for (int64_t j = 0; j < n; ++j) po[i * n + j] += aik * pb[kk * n + j];
    }
  return out;
}

std::vector<int64_t> with_last(const torch::Tensor& t, int64_t last) {
  auto sizes = t.sizes().vec();
  sizes.back() = last;
  return sizes;
}

}  // namespace

torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& weight, const c10::optional<torch::Tensor>& bias) {
  auto out = gemm(x.reshape({-1, x.size(-1)}), weight.t()).reshape(with_last(x, weight.size(0)));
  return bias.has_value() ? out + *bias : out;
}

torch::Tensor input_grad(const torch::Tensor& grad_out, const torch::Tensor& weight) {
  return gemm(grad_out.reshape({-1, grad_out.size(-1)}), weight).reshape(with_last(grad_out, weight.size(1)));
}

torch::Tensor weight_grad(const torch::Tensor& grad_out, const torch::Tensor& x) {
  return gemm(grad_out.reshape({-1, grad_out.size(-1)}).t(), x.reshape({-1, x.size(-1)}));
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("OP") = "linear";
  m.def("forward", &forward, "linear forward", py::arg("x"), py::arg("weight"), py::arg("bias"));
  m.def("input_grad", &input_grad, "linear input gradient", py::arg("grad_out"), py::arg("weight"));
  m.def("weight_grad", &weight_grad, "linear weight gradient", py::arg("grad_out"), py::arg("x"));
}
