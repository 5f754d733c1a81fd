// Decode attention on CPU: one query token per row against that row's cached keys and values.
//
// Why a kernel: at decode, every (row, head) is a 1 x D by D x n product. PyTorch's SDPA runs a
// small GEMM per (row, head) block and costs ~13-25 us per row and layer on a 1M-parameter model,
// a large part of a decode step once ~10 rows run. Keys are cached transposed ([D, L] per row and head), so the scores
// are D passes of a contiguous multiply-add over the row's n positions, which the compiler
// vectorises; values are summed with weights in the same way over D. Each row reads exactly its
// n = lens[b] positions: no padding, no mask.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

// q [B, H, D] float32; kt [R, KH, D, L] (rows 0..B-1 are used); v [R, KH, L, D]; lens [B] int64.
// Returns [B, H, D]. Query heads map to key/value heads in groups of H / KH (GQA).
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor kt, torch::Tensor v, torch::Tensor lens,
                               double scale) {
  TORCH_CHECK(q.dim() == 3 && kt.dim() == 4 && v.dim() == 4 && lens.dim() == 1, "bad ranks");
  TORCH_CHECK(q.scalar_type() == at::kFloat && kt.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "float32 only");
  TORCH_CHECK(lens.scalar_type() == at::kLong, "lens must be int64");
  TORCH_CHECK(q.is_contiguous() && kt.is_contiguous() && v.is_contiguous() && lens.is_contiguous(),
              "contiguous inputs only");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KH = kt.size(1), L = kt.size(3);
  TORCH_CHECK(kt.size(2) == D && v.size(3) == D && v.size(2) == L && v.size(1) == KH, "shape mismatch");
  TORCH_CHECK(kt.size(0) >= B && v.size(0) >= B && lens.size(0) == B && H % KH == 0, "shape mismatch");
  const int64_t group = H / KH;
  const int64_t* lp = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) TORCH_CHECK(lp[b] >= 1 && lp[b] <= L, "lens out of range");

  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = kt.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s(L), acc(D);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, kh = (bh % H) / group, n = lp[b];
      const float* qv = qp + bh * D;
      const float* kb = kp + (b * KH + kh) * D * L;
      const float* vb = vp + (b * KH + kh) * L * D;
      float* sp = s.data();
      for (int64_t p = 0; p < n; ++p) sp[p] = 0.f;
      for (int64_t d = 0; d < D; ++d) {
        const float qd = qv[d] * sc;
        const float* kr = kb + d * L;
#pragma omp simd
        for (int64_t p = 0; p < n; ++p) sp[p] += qd * kr[p];
      }
      float m = sp[0];
      for (int64_t p = 1; p < n; ++p) m = sp[p] > m ? sp[p] : m;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t p = 0; p < n; ++p) {
        const float e = std::exp(sp[p] - m);
        sp[p] = e;
        sum += e;
      }
      float* ap = acc.data();
      for (int64_t d = 0; d < D; ++d) ap[d] = 0.f;
      for (int64_t p = 0; p < n; ++p) {
        const float w = sp[p];
        const float* vr = vb + p * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) ap[d] += w * vr[d];
      }
      float* o = op + bh * D;
      const float inv = 1.f / sum;
      for (int64_t d = 0; d < D; ++d) o[d] = ap[d] * inv;
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "decode attention over per-row cached keys (transposed) and values");
}
