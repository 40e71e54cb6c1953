// ConvPool1D: relu(maxpool(conv1d(x, kernel, VALID), pool) + bias) in one pass over the input, and
// ConvPool1DGrad: its kernel and bias gradients. No input gradient: the op is for the network's first
// conv block, whose input is the data (model/neuron_inverter/conv_pool_op.py).
//
// Why a kernel of its own: the first Neuron-Inverter block makes a 1597 x 30 output per sample from 16
// multiply-adds per value, so with TensorFlow's ops its time goes to memory, not arithmetic (the conv
// output is written, then read by the pooling, by MaxPoolGrad and by the kernel gradient). Here each
// pool window's conv values live only in registers, the forward pass keeps which position won (one
// byte per output), and the gradient reads the input at the winning positions only.
//
// The vectors are GCC/Clang vector extensions of 8 floats: AVX2 registers when compiled with -mavx2,
// pairs of SSE registers otherwise (strategies/cpu_kernels.py chooses the flags). Sums over the batch
// are taken in work units fixed by the batch size, so results do not depend on the thread count.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/util/work_sharder.h"

namespace {

using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Status;
using tensorflow::Tensor;
using tensorflow::TensorShape;
using tensorflow::errors::InvalidArgument;
using tensorflow::shape_inference::DimensionHandle;
using tensorflow::shape_inference::InferenceContext;

constexpr int kLanes = 8;
typedef float Vec __attribute__((vector_size(32)));
typedef int32_t IVec __attribute__((vector_size(32)));
typedef float UVec __attribute__((vector_size(32), aligned(4)));  // the same, at any float address

constexpr int kMaxOutVectors = 8;    // up to 64 output channels
constexpr int kMaxWindowVectors = 4;  // width x input channels up to 32, a multiple of 8
constexpr int kChunks = 16;          // gradient work units, fixed by the batch alone

int Padded(int n) { return (n + kLanes - 1) / kLanes * kLanes; }

struct Shapes {
  int64_t batch;
  int time, in, width, out, pool, positions;
  int rows() const { return width * in; }  // one conv window: width x in contiguous values of x
};

// Samples [begin, end) of the forward pass, NB vectors of output channels held in registers through
// each pool window. `w` is the kernel as (rows, NB * 8), zero beyond the real output channels.
template <int NB>
void Forward(const Shapes& d, const float* x, const float* w, const float* bias, float* y, uint8_t* which,
             int64_t begin, int64_t end) {
  const UVec* wv = reinterpret_cast<const UVec*>(w);
  const int rows = d.rows();
  for (int64_t s = begin; s < end; ++s) {
    for (int p = 0; p < d.positions; ++p) {
      Vec best[NB];
      IVec arg[NB];
      for (int k = 0; k < d.pool; ++k) {
        const float* window = x + (s * d.time + p * d.pool + k) * d.in;
        Vec acc[NB];
        for (int n = 0; n < NB; ++n) acc[n] = Vec{};
        for (int r = 0; r < rows; ++r) {
          const Vec v = Vec{} + window[r];
          for (int n = 0; n < NB; ++n) acc[n] += v * wv[r * NB + n];
        }
        if (k == 0) {
          for (int n = 0; n < NB; ++n) best[n] = acc[n], arg[n] = IVec{};
          continue;
        }
        for (int n = 0; n < NB; ++n) {
          // Strictly larger: ties keep the first position, where MaxPoolGrad sends the gradient too.
          const IVec larger = acc[n] > best[n];
          best[n] = larger ? acc[n] : best[n];
          arg[n] = larger ? IVec{} + k : arg[n];
        }
      }
      alignas(32) float values[NB * kLanes];
      alignas(32) int32_t args[NB * kLanes];
      for (int n = 0; n < NB; ++n) {
        *reinterpret_cast<Vec*>(values + n * kLanes) = best[n];
        *reinterpret_cast<IVec*>(args + n * kLanes) = arg[n];
      }
      float* yp = y + (s * d.positions + p) * d.out;
      uint8_t* wp = which + (s * d.positions + p) * d.out;
      for (int o = 0; o < d.out; ++o) {
        yp[o] = std::max(values[o] + bias[o], 0.f);
        wp[o] = static_cast<uint8_t>(args[o]);
      }
    }
  }
}

// The kernel gradient of samples [first, last) added into `dk` as (out, RB * 8), and the bias
// gradient into `db`: each output's gradient times the input window its pool window's winner read.
template <int RB>
void Backward(const Shapes& d, const float* x, const float* y, const uint8_t* which, const float* grad,
              float* dk, float* db, int64_t first, int64_t last) {
  constexpr int rows = RB * kLanes;
  for (int64_t s = first; s < last; ++s) {
    for (int p = 0; p < d.positions; ++p) {
      const int64_t at = (s * d.positions + p) * d.out;
      const float* start = x + (s * d.time + p * d.pool) * d.in;
      for (int o = 0; o < d.out; ++o) {
        const float g = y[at + o] > 0.f ? grad[at + o] : 0.f;  // through the ReLU
        const UVec* window = reinterpret_cast<const UVec*>(start + which[at + o] * d.in);
        UVec* dko = reinterpret_cast<UVec*>(dk + o * rows);
        for (int n = 0; n < RB; ++n) dko[n] += g * window[n];
        db[o] += g;
      }
    }
  }
}

template <typename F>
void Parallel(OpKernelContext* context, int64_t units, int64_t cost_per_unit, F work) {
  auto* threads = context->device()->tensorflow_cpu_worker_threads();
  tensorflow::Shard(threads->num_threads, threads->workers, units, cost_per_unit, work);
}

class ConvPool1DOp : public OpKernel {
 public:
  explicit ConvPool1DOp(OpKernelConstruction* context) : OpKernel(context) {
    OP_REQUIRES_OK(context, context->GetAttr("pool", &pool_));
  }

  void Compute(OpKernelContext* context) override {
    const Tensor& x = context->input(0);
    const Tensor& kernel = context->input(1);
    const Tensor& bias = context->input(2);
    OP_REQUIRES(context, x.dims() == 3 && kernel.dims() == 3 && bias.dims() == 1,
                InvalidArgument("ConvPool1D takes x (batch, time, in), kernel (width, in, out), bias (out)"));
    Shapes d{x.dim_size(0), static_cast<int>(x.dim_size(1)), static_cast<int>(x.dim_size(2)),
             static_cast<int>(kernel.dim_size(0)), static_cast<int>(kernel.dim_size(2)), pool_, 0};
    d.positions = (d.time - d.width + 1) / d.pool;
    OP_REQUIRES(context, kernel.dim_size(1) == d.in && bias.dim_size(0) == d.out,
                InvalidArgument("ConvPool1D: the kernel and bias do not match x's channels"));
    OP_REQUIRES(context, d.positions > 0, InvalidArgument("ConvPool1D: x is shorter than one pool window"));
    OP_REQUIRES(context, d.out <= kMaxOutVectors * kLanes && d.pool <= 255,
                InvalidArgument("ConvPool1D: at most 64 output channels and pools of at most 255"));
    Tensor* y = nullptr;
    Tensor* which = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(0, TensorShape({d.batch, d.positions, d.out}), &y));
    OP_REQUIRES_OK(context, context->allocate_output(1, TensorShape({d.batch, d.positions, d.out}), &which));
    const int vectors = Padded(d.out) / kLanes, rows = d.rows();
    std::vector<float> w(static_cast<size_t>(rows) * vectors * kLanes, 0.f);
    const float* k = kernel.flat<float>().data();
    for (int r = 0; r < rows; ++r) std::copy(k + r * d.out, k + (r + 1) * d.out, &w[r * vectors * kLanes]);
    const float* xs = x.flat<float>().data();
    const float* b = bias.flat<float>().data();
    float* ys = y->flat<float>().data();
    uint8_t* ws = which->flat<uint8_t>().data();
    auto samples = [&](int64_t begin, int64_t end) {
      switch (vectors) {
#define CONV_POOL_CASE(NB) \
  case NB:                 \
    return Forward<NB>(d, xs, w.data(), b, ys, ws, begin, end);
        CONV_POOL_CASE(1) CONV_POOL_CASE(2) CONV_POOL_CASE(3) CONV_POOL_CASE(4)
        CONV_POOL_CASE(5) CONV_POOL_CASE(6) CONV_POOL_CASE(7) CONV_POOL_CASE(8)
#undef CONV_POOL_CASE
      }
    };
    Parallel(context, d.batch, static_cast<int64_t>(d.positions) * d.pool * rows * vectors * kLanes, samples);
  }

 private:
  int pool_;
};

class ConvPool1DGradOp : public OpKernel {
 public:
  explicit ConvPool1DGradOp(OpKernelConstruction* context) : OpKernel(context) {
    OP_REQUIRES_OK(context, context->GetAttr("pool", &pool_));
    OP_REQUIRES_OK(context, context->GetAttr("width", &width_));
  }

  void Compute(OpKernelContext* context) override {
    const Tensor& x = context->input(0);
    const Tensor& y = context->input(1);
    const Tensor& which = context->input(2);
    const Tensor& grad = context->input(3);
    OP_REQUIRES(context, x.dims() == 3 && y.dims() == 3 && which.shape() == y.shape() &&
                             grad.shape() == y.shape() && y.dim_size(0) == x.dim_size(0),
                InvalidArgument("ConvPool1DGrad: x must be 3-D, and y, which and grad of one shape"));
    Shapes d{x.dim_size(0), static_cast<int>(x.dim_size(1)), static_cast<int>(x.dim_size(2)), width_,
             static_cast<int>(y.dim_size(2)), pool_, static_cast<int>(y.dim_size(1))};
    const int rows = d.rows();
    OP_REQUIRES(context, rows % kLanes == 0 && rows <= kMaxWindowVectors * kLanes,
                InvalidArgument("ConvPool1DGrad: width x input channels must be 8, 16, 24 or 32"));
    Tensor* kernel_grad = nullptr;
    Tensor* bias_grad = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(0, TensorShape({d.width, d.in, d.out}), &kernel_grad));
    OP_REQUIRES_OK(context, context->allocate_output(1, TensorShape({d.out}), &bias_grad));
    const float* xs = x.flat<float>().data();
    const float* ys = y.flat<float>().data();
    const uint8_t* ws = which.flat<uint8_t>().data();
    const float* gs = grad.flat<float>().data();
    const int64_t chunks = std::min<int64_t>(kChunks, std::max<int64_t>(d.batch, 1));
    const int64_t unit = static_cast<int64_t>(d.out) * (rows + 1);  // one chunk's (out, rows) + (out)
    std::vector<float> partial(chunks * unit, 0.f);
    auto work = [&](int64_t begin, int64_t end) {
      for (int64_t c = begin; c < end; ++c) {
        float* dk = &partial[c * unit];
        float* db = dk + d.out * rows;
        const int64_t first = d.batch * c / chunks, last = d.batch * (c + 1) / chunks;
        switch (rows / kLanes) {
#define CONV_POOL_CASE(RB) \
  case RB:                 \
    Backward<RB>(d, xs, ys, ws, gs, dk, db, first, last); \
    break;
          CONV_POOL_CASE(1) CONV_POOL_CASE(2) CONV_POOL_CASE(3) CONV_POOL_CASE(4)
#undef CONV_POOL_CASE
        }
      }
    };
    Parallel(context, chunks, (d.batch / chunks + 1) * d.positions * d.out * rows, work);
    float* dk = kernel_grad->flat<float>().data();
    float* db = bias_grad->flat<float>().data();
    std::fill(dk, dk + rows * d.out, 0.f);
    std::fill(db, db + d.out, 0.f);
    for (int64_t c = 0; c < chunks; ++c) {  // in chunk order: the same sums for any thread count
      const float* pk = &partial[c * unit];
      for (int o = 0; o < d.out; ++o) {
        for (int r = 0; r < rows; ++r) dk[r * d.out + o] += pk[o * rows + r];
        db[o] += pk[d.out * rows + o];
      }
    }
  }

 private:
  int pool_;
  int width_;
};

Status ConvPool1DShape(InferenceContext* c) {
  int pool;
  TF_RETURN_IF_ERROR(c->GetAttr("pool", &pool));
  const auto x = c->input(0), kernel = c->input(1);
  DimensionHandle positions = c->UnknownDim();
  if (c->RankKnown(x) && c->RankKnown(kernel) && c->ValueKnown(c->Dim(x, 1)) && c->ValueKnown(c->Dim(kernel, 0)))
    positions = c->MakeDim((c->Value(c->Dim(x, 1)) - c->Value(c->Dim(kernel, 0)) + 1) / pool);
  const auto shape = c->MakeShape({c->Dim(x, 0), positions, c->Dim(kernel, 2)});
  c->set_output(0, shape);
  c->set_output(1, shape);
  return Status();
}

Status ConvPool1DGradShape(InferenceContext* c) {
  int width;
  TF_RETURN_IF_ERROR(c->GetAttr("width", &width));
  const auto x = c->input(0), y = c->input(1);
  c->set_output(0, c->MakeShape({c->MakeDim(width), c->Dim(x, 2), c->Dim(y, 2)}));
  c->set_output(1, c->MakeShape({c->Dim(y, 2)}));
  return Status();
}

}  // namespace

REGISTER_OP("ConvPool1D")
    .Input("x: float")
    .Input("kernel: float")
    .Input("bias: float")
    .Output("y: float")
    .Output("which: uint8")
    .Attr("pool: int >= 1")
    .SetShapeFn(ConvPool1DShape);

REGISTER_OP("ConvPool1DGrad")
    .Input("x: float")
    .Input("y: float")
    .Input("which: uint8")
    .Input("grad: float")
    .Output("kernel_grad: float")
    .Output("bias_grad: float")
    .Attr("pool: int >= 1")
    .Attr("width: int >= 1")
    .SetShapeFn(ConvPool1DGradShape);

REGISTER_KERNEL_BUILDER(Name("ConvPool1D").Device(tensorflow::DEVICE_CPU), ConvPool1DOp);
REGISTER_KERNEL_BUILDER(Name("ConvPool1DGrad").Device(tensorflow::DEVICE_CPU), ConvPool1DGradOp);
