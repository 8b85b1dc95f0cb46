#include "paratrain/parallel/comm_hooks.h"

#include <c10/util/Exception.h>

namespace paratrain {

dist::WorkPtr AllreduceHook::run(dist::ProcessGroup& pg, at::Tensor& bucket) {
  bucket.div_(pg.size());
  return pg.allreduce(bucket, dist::ReduceOp::kSum);
}

namespace {
// Waits for the compressed allreduce, then writes the result back into the bucket.
class DecompressWork : public dist::Work {
 public:
  DecompressWork(dist::WorkPtr inner, at::Tensor compressed, at::Tensor bucket)
      : inner_(std::move(inner)), compressed_(std::move(compressed)), bucket_(std::move(bucket)) {}
  void wait() override {
    if (!done_) {
      inner_->wait();
      bucket_.copy_(compressed_);
      done_ = true;
    }
  }
  // Complete only once the result is back in the bucket.
  bool is_completed() override {
    if (!done_ && inner_->is_completed()) {
      wait();
    }
    return done_;
  }

 private:
  dist::WorkPtr inner_;
  at::Tensor compressed_;
  at::Tensor bucket_;
  bool done_ = false;
};
}  // namespace

CompressionHook::CompressionHook(at::ScalarType dtype) : dtype_(dtype) {
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16,
              "CompressionHook: dtype must be Half or BFloat16, got ", dtype);
}

std::string CompressionHook::name() const {
  return dtype_ == at::kHalf ? "fp16_compress" : "bf16_compress";
}

dist::WorkPtr CompressionHook::run(dist::ProcessGroup& pg, at::Tensor& bucket) {
  at::Tensor compressed = bucket.to(dtype_).div_(pg.size());
  auto work = pg.allreduce(compressed, dist::ReduceOp::kSum);
  return std::make_shared<DecompressWork>(std::move(work), compressed, bucket);
}

std::shared_ptr<CommHook> fp16_compress_hook() {
  return std::make_shared<CompressionHook>(at::kHalf);
}

std::shared_ptr<CommHook> bf16_compress_hook() {
  return std::make_shared<CompressionHook>(at::kBFloat16);
}

}  // namespace paratrain
