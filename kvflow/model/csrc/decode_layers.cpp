// A decode step's layers in one call.
// The layer loop of LlamaModel.run_layers for a batch of decode rows only, in C++: the same kernels
// and projections in the same order (the results are bitwise the model's), without a Python call per
// op. Run from Python, the ~25 calls per layer left the OpenMP workers waiting for the next op for
// much of a decode step (docs/model.md). Projections take the path the model chose for this row count:
// 0 skinny_linear on the plain weight, 1 oneDNN's prepacked linear, 2 the same on rows padded to 4,
// 3 at::linear on the plain weight, 4 invariant_linear on the weights packed for it; a batch-invariant
// model (`invariant`) takes invariant_linear on its packed weights and attends through
// paged_decode_invariant instead.
#include "kernel_utils.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/linear.h>

#include <string>

static at::Tensor project(const at::Tensor& x, const at::Tensor& w, const at::Tensor& packed, int64_t path, bool invariant) {
  if (invariant || path == 4) return invariant_linear(x, packed, w.size(0));
  if (path == 0) return skinny_linear(x, w);
  if (path == 3) return at::linear(x, w);
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  const int64_t n = x.size(0);
  const bool pad = path == 2 && n < 4;
  torch::jit::Stack st{pad ? at::constant_pad_nd(x, {0, 0, 0, 4 - n}) : x, packed, c10::IValue(), c10::IValue(std::string("none")),
                       c10::IValue(c10::List<std::optional<c10::Scalar>>()), c10::IValue(std::string(""))};
  op.callBoxed(&st);
  at::Tensor y = st[0].toTensor();
  return pad ? y.narrow(0, 0, n) : y;
}

// x [T, hidden] (the residual stream), per layer: norms, the four projections' plain weights and
// prepacked ones (w / packed: qkv, o, gate_up, down of layer 0, then layer 1, ...), its KV view;
// -> (residual stream, the last MLP output still to be added to it).
std::vector<at::Tensor> decode_layers(at::Tensor x, std::vector<at::Tensor> in_norm, std::vector<at::Tensor> post_norm,
    std::vector<at::Tensor> w, std::vector<at::Tensor> packed, int64_t path, std::vector<at::Tensor> kv,
    at::Tensor cos, at::Tensor sin, at::Tensor slots, at::Tensor table, at::Tensor ctx,
    double eps, double scale, int64_t H, int64_t KVH, bool invariant) {
  NoGil no_gil;
  const size_t L = in_norm.size();
  const int64_t T = x.size(0), D = cos.size(1);
  TORCH_CHECK(post_norm.size() == L && kv.size() == L && w.size() == 4 * L && packed.size() == 4 * L, "decode_layers: per-layer lists");
  at::Tensor delta;
  for (size_t l = 0; l < L; ++l) {
    at::Tensor h;
    if (delta.defined()) {
      h = add_rms_norm(delta, x, in_norm[l], eps);  // delta += x: the sum is the residual stream
      x = delta;
    } else {
      h = rms_norm(x, in_norm[l], eps);
    }
    at::Tensor qkv = project(h, w[4 * l], packed[4 * l], path, invariant);
    rope_write(qkv, cos, sin, H, KVH, kv[l], slots);
    at::Tensor q = qkv.narrow(1, 0, H * D).view({T, H, D}).contiguous();
    at::Tensor attn = invariant ? paged_decode_invariant(q, kv[l], table, ctx, scale) : paged_decode(q, kv[l], table, ctx, scale);
    at::Tensor o = project(attn.view({T, H * D}), w[4 * l + 1], packed[4 * l + 1], path, invariant);
    h = add_rms_norm(o, x, post_norm[l], eps);
    x = o;
    delta = project(silu_mul(project(h, w[4 * l + 2], packed[4 * l + 2], path, invariant)), w[4 * l + 3], packed[4 * l + 3],
                    path, invariant);
  }
  return {x, delta};
}
