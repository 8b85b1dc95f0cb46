#include "paratrain/data/transforms.h"

#include "paratrain/data/image.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <sstream>
#include <typeinfo>

namespace paratrain {
namespace data {

namespace {

// splitmix64: decorrelates nearby (seed, epoch, position) triples before they seed the engine.
uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

thread_local Generator tls_generator{0};

// Our own mappings from the engine's bits, rather than std::uniform_*_distribution, whose
// algorithms differ between standard libraries: the same seed gives the same crops on every build.
double uniform(Generator& gen, double lo, double hi) {
  const double u = static_cast<double>(gen() >> 11) * (1.0 / 9007199254740992.0);  // [0, 1)
  return lo + (hi - lo) * u;
}

int64_t randint(Generator& gen, int64_t n) {  // [0, n)
  return static_cast<int64_t>(uniform(gen, 0.0, static_cast<double>(n)));
}

// Python's round(): half to even, as torchvision's int(round(...)).
int64_t round_half_even(double x) {
  return static_cast<int64_t>(std::nearbyint(x));
}

void check_image(const torch::Tensor& image, const char* what) {
  TORCH_CHECK(image.dim() == 3, what, ": expected an image [C, H, W], got sizes ", image.sizes());
  TORCH_CHECK(image.device().is_cpu(), what, ": expected a CPU image, got one on ", image.device());
}

std::string size_repr(const transforms::Size& s) {
  std::ostringstream o;
  if (s.single) {
    o << s.height;
  } else {
    o << "(" << s.height << ", " << s.width << ")";
  }
  return o.str();
}

// ---- the resampler ------------------------------------------------------------------------------

// The taps of one output pixel along one dimension, as ATen's antialiased bilinear kernel
// (aten/src/ATen/native/cpu/UpSampleKernel.cpp, _compute_weights_aa) computes them, in float: a
// triangle filter widened by the downscaling factor, normalised to sum 1.
struct Taps {
  std::vector<int64_t> start;
  std::vector<int64_t> count;
  std::vector<float> weights;  // out * width
  int64_t width = 0;
};

Taps make_taps(int64_t in, int64_t out) {
  Taps t;
  const float scale = static_cast<float>(in) / static_cast<float>(out);
  const float support = scale >= 1.0f ? scale : 1.0f;
  const float invscale = scale >= 1.0f ? 1.0f / scale : 1.0f;
  t.width = static_cast<int64_t>(std::ceil(support)) * 2 + 1;
  t.start.resize(static_cast<size_t>(out));
  t.count.resize(static_cast<size_t>(out));
  t.weights.assign(static_cast<size_t>(out * t.width), 0.0f);
  for (int64_t i = 0; i < out; ++i) {
    const float center = scale * (static_cast<float>(i) + 0.5f);
    const int64_t lo = std::max<int64_t>(static_cast<int64_t>(center - support + 0.5f), 0);
    const int64_t n = std::min<int64_t>(
        std::min<int64_t>(static_cast<int64_t>(center + support + 0.5f), in) - lo, t.width);
    float* w = &t.weights[static_cast<size_t>(i * t.width)];
    float total = 0.0f;
    for (int64_t j = 0; j < n; ++j) {
      const float x = std::abs((static_cast<float>(j + lo) - center + 0.5f) * invscale);
      w[j] = x < 1.0f ? 1.0f - x : 0.0f;
      total += w[j];
    }
    for (int64_t j = 0; j < n && total != 0.0f; ++j) {
      w[j] /= total;
    }
    t.start[static_cast<size_t>(i)] = lo;
    t.count[static_cast<size_t>(i)] = n;
  }
  return t;
}

// Reads [C, H, W] of any strides as float planes [C][H][W].
template <typename T>
std::vector<float> load_planes(const torch::Tensor& image) {
  const int64_t c = image.size(0), h = image.size(1), w = image.size(2);
  const int64_t sc = image.stride(0), sh = image.stride(1), sw = image.stride(2);
  const T* p = image.data_ptr<T>();
  std::vector<float> out(static_cast<size_t>(c * h * w));
  float* o = out.data();
  for (int64_t k = 0; k < c; ++k) {
    for (int64_t y = 0; y < h; ++y) {
      const T* row = p + k * sc + y * sh;
      for (int64_t x = 0; x < w; ++x) {
        *o++ = static_cast<float>(row[x * sw]);
      }
    }
  }
  return out;
}

// One horizontal pass: rows of `in` ([rows][in_w]) to rows of out_w.
std::vector<float> resample_rows(const std::vector<float>& in,
                                 int64_t rows,
                                 int64_t in_w,
                                 int64_t out_w) {
  if (in_w == out_w) {
    return in;
  }
  const Taps t = make_taps(in_w, out_w);
  std::vector<float> out(static_cast<size_t>(rows * out_w));
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = &in[static_cast<size_t>(r * in_w)];
    float* dst = &out[static_cast<size_t>(r * out_w)];
    for (int64_t x = 0; x < out_w; ++x) {
      const float* w = &t.weights[static_cast<size_t>(x * t.width)];
      const float* s = src + t.start[static_cast<size_t>(x)];
      float acc = 0.0f;
      for (int64_t j = 0; j < t.count[static_cast<size_t>(x)]; ++j) {
        acc += s[j] * w[j];
      }
      dst[x] = acc;
    }
  }
  return out;
}

// One vertical pass over each of `planes` planes [in_h][w] to [out_h][w].
std::vector<float> resample_columns(
    const std::vector<float>& in, int64_t planes, int64_t in_h, int64_t out_h, int64_t w) {
  if (in_h == out_h) {
    return in;
  }
  const Taps t = make_taps(in_h, out_h);
  std::vector<float> out(static_cast<size_t>(planes * out_h * w), 0.0f);
  for (int64_t k = 0; k < planes; ++k) {
    for (int64_t y = 0; y < out_h; ++y) {
      const float* wt = &t.weights[static_cast<size_t>(y * t.width)];
      float* dst = &out[static_cast<size_t>((k * out_h + y) * w)];
      for (int64_t j = 0; j < t.count[static_cast<size_t>(y)]; ++j) {
        const float* src =
            &in[static_cast<size_t>((k * in_h + t.start[static_cast<size_t>(y)] + j) * w)];
        const float wj = wt[j];
        for (int64_t x = 0; x < w; ++x) {
          dst[x] += src[x] * wj;
        }
      }
    }
  }
  return out;
}

}  // namespace

Generator& sample_generator() {
  return tls_generator;
}

void seed_sample_generator(uint64_t seed, uint64_t epoch, uint64_t position, uint64_t index) {
  tls_generator.seed(mix(mix(mix(mix(seed) ^ epoch) ^ position) ^ index));
}

namespace transforms {

torch::Tensor resize_bilinear(const torch::Tensor& image, int64_t height, int64_t width) {
  check_image(image, "resize");
  TORCH_CHECK(height > 0 && width > 0, "resize: the output size must be positive, got ", height,
              "x", width);
  const bool bytes = image.scalar_type() == torch::kUInt8;
  TORCH_CHECK(bytes || image.scalar_type() == torch::kFloat, "resize: expected a uint8 or float ",
              "image, got ", image.scalar_type());
  const int64_t c = image.size(0), h = image.size(1), w = image.size(2);
  TORCH_CHECK(h > 0 && w > 0, "resize: empty image ", image.sizes());
  std::vector<float> planes = bytes ? load_planes<uint8_t>(image) : load_planes<float>(image);
  // Width first, then height, as ATen's separable kernel: same sums in the same order.
  std::vector<float> across = resample_rows(planes, c * h, w, width);
  std::vector<float> out = resample_columns(across, c, h, height, width);
  torch::Tensor result = torch::empty({c, height, width}, bytes ? torch::kUInt8 : torch::kFloat);
  if (bytes) {
    uint8_t* dst = result.data_ptr<uint8_t>();
    for (size_t i = 0; i < out.size(); ++i) {
      const float v = std::nearbyint(out[i]);  // torch.round: half to even
      dst[i] = static_cast<uint8_t>(v < 0.0f ? 0.0f : v > 255.0f ? 255.0f : v);
    }
  } else {
    std::copy(out.begin(), out.end(), result.data_ptr<float>());
  }
  return result;
}

// ---- Resize
// ---------------------------------------------------------------------------------------

Resize::Resize(Size size) : size_(size) {
  TORCH_CHECK(size.height > 0 && size.width > 0, "Resize: the size must be positive, got ",
              size_repr(size));
}

std::array<int64_t, 2> Resize::output_size(int64_t height, int64_t width) const {
  if (!size_.single) {
    return {size_.height, size_.width};
  }
  // torchvision's _compute_resized_output_size: the shorter side becomes size, the longer
  // int(size * long / short).
  const int64_t s = size_.height;
  if (width <= height) {
    return {static_cast<int64_t>(static_cast<double>(s) * height / width), s};
  }
  return {s, static_cast<int64_t>(static_cast<double>(s) * width / height)};
}

torch::Tensor Resize::apply(const torch::Tensor& image, Generator&) const {
  check_image(image, "Resize");
  const auto out = output_size(image.size(1), image.size(2));
  if (out[0] == image.size(1) && out[1] == image.size(2)) {
    return image;
  }
  return resize_bilinear(image, out[0], out[1]);
}

std::string Resize::name() const {
  return "Resize(size=" + size_repr(size_) + ", interpolation=bilinear, antialias=True)";
}

// ---- CenterCrop
// -----------------------------------------------------------------------------------

CenterCrop::CenterCrop(Size size) : size_(size) {
  TORCH_CHECK(size.height > 0 && size.width > 0, "CenterCrop: the size must be positive, got ",
              size_repr(size));
}

torch::Tensor CenterCrop::apply(const torch::Tensor& image, Generator&) const {
  check_image(image, "CenterCrop");
  const int64_t h = image.size(1), w = image.size(2);
  TORCH_CHECK(h >= size_.height && w >= size_.width, "CenterCrop(", size_repr(size_),
              "): the image is ", h, "x", w, " (HxW), smaller than the crop; resize it first ",
              "(e.g. Resize(", std::max(size_.height, size_.width), ") before the crop)");
  const int64_t top = round_half_even(static_cast<double>(h - size_.height) / 2.0);
  const int64_t left = round_half_even(static_cast<double>(w - size_.width) / 2.0);
  return image.slice(1, top, top + size_.height).slice(2, left, left + size_.width);
}

std::string CenterCrop::name() const {
  return "CenterCrop(size=" + size_repr(size_) + ")";
}

// ---- RandomResizedCrop
// ----------------------------------------------------------------------------

RandomResizedCrop::RandomResizedCrop(Size size,
                                     std::array<double, 2> scale,
                                     std::array<double, 2> ratio)
    : size_(size), scale_(scale), ratio_(ratio) {
  TORCH_CHECK(size.height > 0 && size.width > 0,
              "RandomResizedCrop: the size must be positive, got ", size_repr(size));
  TORCH_CHECK(scale[0] > 0 && scale[0] <= scale[1], "RandomResizedCrop: scale must be (min, max) ",
              "with 0 < min <= max, got (", scale[0], ", ", scale[1], ")");
  TORCH_CHECK(ratio[0] > 0 && ratio[0] <= ratio[1], "RandomResizedCrop: ratio must be (min, max) ",
              "with 0 < min <= max, got (", ratio[0], ", ", ratio[1], ")");
}

std::array<int64_t, 4> RandomResizedCrop::params(int64_t height,
                                                 int64_t width,
                                                 Generator& gen) const {
  const double area = static_cast<double>(height) * static_cast<double>(width);
  const double log_lo = std::log(ratio_[0]), log_hi = std::log(ratio_[1]);
  for (int attempt = 0; attempt < 10; ++attempt) {
    const double target = area * uniform(gen, scale_[0], scale_[1]);
    const double aspect = std::exp(uniform(gen, log_lo, log_hi));
    const int64_t w = round_half_even(std::sqrt(target * aspect));
    const int64_t h = round_half_even(std::sqrt(target / aspect));
    if (0 < w && w <= width && 0 < h && h <= height) {
      const int64_t top = randint(gen, height - h + 1);
      const int64_t left = randint(gen, width - w + 1);
      return {top, left, h, w};
    }
  }
  // torchvision's fallback: the central crop, at the nearest allowed aspect ratio.
  const double in_ratio = static_cast<double>(width) / static_cast<double>(height);
  int64_t w = width, h = height;
  if (in_ratio < ratio_[0]) {
    h = round_half_even(static_cast<double>(w) / ratio_[0]);
  } else if (in_ratio > ratio_[1]) {
    w = round_half_even(static_cast<double>(h) * ratio_[1]);
  }
  return {(height - h) / 2, (width - w) / 2, h, w};
}

torch::Tensor RandomResizedCrop::apply(const torch::Tensor& image, Generator& gen) const {
  check_image(image, "RandomResizedCrop");
  const auto box = params(image.size(1), image.size(2), gen);
  torch::Tensor crop = image.slice(1, box[0], box[0] + box[2]).slice(2, box[1], box[1] + box[3]);
  return resize_bilinear(crop, size_.height, size_.width);
}

std::string RandomResizedCrop::name() const {
  std::ostringstream o;
  o << "RandomResizedCrop(size=" << size_repr(size_) << ", scale=(" << scale_[0] << ", "
    << scale_[1] << "), ratio=(" << ratio_[0] << ", " << ratio_[1]
    << "), interpolation=bilinear, antialias=True)";
  return o.str();
}

// ---- RandomHorizontalFlip
// -------------------------------------------------------------------------

RandomHorizontalFlip::RandomHorizontalFlip(double p) : p_(p) {
  TORCH_CHECK(p >= 0 && p <= 1, "RandomHorizontalFlip: p must be in [0, 1], got ", p);
}

namespace {

template <typename T>
torch::Tensor flip_width(const torch::Tensor& image) {
  const int64_t c = image.size(0), h = image.size(1), w = image.size(2);
  const int64_t sc = image.stride(0), sh = image.stride(1), sw = image.stride(2);
  torch::Tensor out = torch::empty({c, h, w}, image.scalar_type());
  const T* src = image.data_ptr<T>();
  T* dst = out.data_ptr<T>();
  for (int64_t k = 0; k < c; ++k) {
    for (int64_t y = 0; y < h; ++y) {
      const T* row = src + k * sc + y * sh;
      T* o = dst + (k * h + y) * w;
      for (int64_t x = 0; x < w; ++x) {
        o[x] = row[(w - 1 - x) * sw];
      }
    }
  }
  return out;
}

}  // namespace

torch::Tensor RandomHorizontalFlip::apply(const torch::Tensor& image, Generator& gen) const {
  check_image(image, "RandomHorizontalFlip");
  if (!(uniform(gen, 0.0, 1.0) < p_)) {
    return image;
  }
  if (image.scalar_type() == torch::kUInt8) {
    return flip_width<uint8_t>(image);
  }
  if (image.scalar_type() == torch::kFloat) {
    return flip_width<float>(image);
  }
  return image.flip({2});
}

std::string RandomHorizontalFlip::name() const {
  std::ostringstream o;
  o << "RandomHorizontalFlip(p=" << p_ << ")";
  return o.str();
}

// ---- ConvertImageDtype / ToTensor
// -----------------------------------------------------------------

ConvertImageDtype::ConvertImageDtype(torch::ScalarType dtype) {
  TORCH_CHECK(dtype == torch::kFloat, "ConvertImageDtype: only torch.float32 output is supported, ",
              "got ", dtype);
}

torch::Tensor ConvertImageDtype::apply(const torch::Tensor& image, Generator&) const {
  check_image(image, "ConvertImageDtype");
  if (image.scalar_type() == torch::kFloat) {
    return image;
  }
  TORCH_CHECK(image.scalar_type() == torch::kUInt8, name(), ": expected a uint8 or float image, ",
              "got ", image.scalar_type());
  const int64_t c = image.size(0), h = image.size(1), w = image.size(2);
  const int64_t sc = image.stride(0), sh = image.stride(1), sw = image.stride(2);
  torch::Tensor out = torch::empty({c, h, w}, torch::kFloat);
  const uint8_t* src = image.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  for (int64_t k = 0; k < c; ++k) {
    for (int64_t y = 0; y < h; ++y) {
      const uint8_t* row = src + k * sc + y * sh;
      for (int64_t x = 0; x < w; ++x) {
        *dst++ = static_cast<float>(row[x * sw]) / 255.0f;
      }
    }
  }
  return out;
}

std::string ConvertImageDtype::name() const {
  return "ConvertImageDtype(torch.float32)";
}

// ---- Normalize
// ------------------------------------------------------------------------------------

Normalize::Normalize(std::vector<double> mean, std::vector<double> std)
    : mean_(std::move(mean)), std_(std::move(std)) {
  TORCH_CHECK(!mean_.empty() && !std_.empty(), "Normalize: mean and std must not be empty");
  for (double s : std_) {
    TORCH_CHECK(s != 0, "Normalize: std evaluated to zero after conversion to float, leading to ",
                "division by zero");
  }
}

torch::Tensor Normalize::apply(const torch::Tensor& image, Generator&) const {
  check_image(image, "Normalize");
  TORCH_CHECK(image.scalar_type() == torch::kFloat, "Normalize: the image must be float (put ",
              "ToTensor or ConvertImageDtype before it), got ", image.scalar_type());
  const int64_t c = image.size(0);
  auto pick = [&](const std::vector<double>& v, int64_t k, const char* what) {
    TORCH_CHECK(v.size() == 1 || static_cast<int64_t>(v.size()) == c, "Normalize: ", v.size(),
                " values of ", what, " for an image of ", c, " channels");
    return static_cast<float>(v.size() == 1 ? v[0] : v[static_cast<size_t>(k)]);
  };
  torch::Tensor src = image.is_contiguous() ? image : image.contiguous();
  torch::Tensor out = torch::empty_like(src);
  const int64_t plane = src.size(1) * src.size(2);
  const float* in = src.data_ptr<float>();
  float* o = out.data_ptr<float>();
  for (int64_t k = 0; k < c; ++k) {
    const float m = pick(mean_, k, "mean");
    const float s = pick(std_, k, "std");
    for (int64_t i = 0; i < plane; ++i) {
      o[k * plane + i] = (in[k * plane + i] - m) / s;
    }
  }
  return out;
}

std::string Normalize::name() const {
  std::ostringstream o;
  o << "Normalize(mean=" << c10::ArrayRef<double>(mean_) << ", std=" << c10::ArrayRef<double>(std_)
    << ")";
  return o.str();
}

// ---- Compose
// --------------------------------------------------------------------------------------

Compose::Compose(std::vector<TransformPtr> transforms) : transforms_(std::move(transforms)) {
  for (const auto& t : transforms_) {
    TORCH_CHECK(t != nullptr, "Compose: a transform is null");
  }
}

namespace {

// ConvertImageDtype then Normalize in one pass: float(x) / 255, then (v - mean) / std, as the two
// steps compute it, without the intermediate image (a 600 KB allocation per 224x224 image).
torch::Tensor bytes_to_normalized(const torch::Tensor& image, const Normalize& n) {
  const int64_t c = image.size(0), h = image.size(1), w = image.size(2);
  auto pick = [&](const std::vector<double>& v, int64_t k, const char* what) {
    TORCH_CHECK(v.size() == 1 || static_cast<int64_t>(v.size()) == c, "Normalize: ", v.size(),
                " values of ", what, " for an image of ", c, " channels");
    return static_cast<float>(v.size() == 1 ? v[0] : v[static_cast<size_t>(k)]);
  };
  const int64_t sc = image.stride(0), sh = image.stride(1), sw = image.stride(2);
  torch::Tensor out = torch::empty({c, h, w}, torch::kFloat);
  const uint8_t* src = image.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  for (int64_t k = 0; k < c; ++k) {
    const float m = pick(n.mean(), k, "mean");
    const float s = pick(n.std(), k, "std");
    for (int64_t y = 0; y < h; ++y) {
      const uint8_t* row = src + k * sc + y * sh;
      for (int64_t x = 0; x < w; ++x) {
        *dst++ = (static_cast<float>(row[x * sw]) / 255.0f - m) / s;
      }
    }
  }
  return out;
}

// Each step of `chain` in turn, with ConvertImageDtype + Normalize fused.
torch::Tensor run_chain(const std::vector<const Transform*>& chain,
                        torch::Tensor x,
                        Generator& gen) {
  for (size_t i = 0; i < chain.size(); ++i) {
    // Exactly these two types (a user's subclass may do something else in apply()).
    const bool to_float =
        typeid(*chain[i]) == typeid(ConvertImageDtype) || typeid(*chain[i]) == typeid(ToTensor);
    const auto* normalize =
        i + 1 < chain.size() ? dynamic_cast<const Normalize*>(chain[i + 1]) : nullptr;
    if (to_float && normalize && x.dim() == 3 && x.scalar_type() == torch::kUInt8 &&
        x.device().is_cpu()) {
      x = bytes_to_normalized(x, *normalize);
      ++i;
      continue;
    }
    x = chain[i]->apply(x, gen);
  }
  return x;
}

}  // namespace

torch::Tensor Compose::apply(const torch::Tensor& image, Generator& gen) const {
  std::vector<const Transform*> chain;
  for (const auto& t : transforms_) {
    chain.push_back(t.get());
  }
  return run_chain(chain, image, gen);
}

std::string Compose::name() const {
  std::string s = "Compose(";
  for (const auto& t : transforms_) {
    s += "\n    " + t->name();
  }
  return s + "\n)";
}

// ---- decode, then transform
// -------------------------------------------------------------------------

namespace {

// The first step of a (possibly nested) Compose, and the steps after it.
const Transform* first_step(const Transform* t, std::vector<const Transform*>& rest) {
  while (const auto* c = dynamic_cast<const Compose*>(t)) {
    if (c->transforms().empty()) {
      return nullptr;
    }
    for (size_t i = c->transforms().size(); i-- > 1;) {
      rest.insert(rest.begin(), c->transforms()[i].get());
    }
    t = c->transforms()[0].get();
  }
  return t;
}

int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

}  // namespace

torch::Tensor decode_and_transform(const std::string& bytes,
                                   const std::string& name,
                                   const Transform* transform,
                                   Generator& gen,
                                   bool draft) {
  const bool jpeg = sniff_image_format(bytes.data(), bytes.size()) == ImageFormat::kJpeg;
  if (transform == nullptr) {
    return decode_image(bytes, name);
  }
  if (!draft || !jpeg) {
    return transform->apply(decode_image(bytes, name), gen);
  }
  std::vector<const Transform*> rest;
  const Transform* first = first_step(transform, rest);
  const ImageSize full = read_image_size(bytes, name);
  torch::Tensor x;
  if (const auto* r = dynamic_cast<const Resize*>(first)) {
    // Decode at least as large as Resize's output (computed from the full size, so the result has
    // exactly the size it would have had), then resize to it.
    const auto out = r->output_size(full.height, full.width);
    x = decode_image(bytes, name, {out[0], out[1]});
    if (x.size(1) != out[0] || x.size(2) != out[1]) {
      x = resize_bilinear(x, out[0], out[1]);
    }
  } else if (const auto* c = dynamic_cast<const RandomResizedCrop*>(first)) {
    // The box is drawn on the full size (the same draws as without draft); the decoded image only
    // has to keep the box at least as large as the output.
    const auto box = c->params(full.height, full.width, gen);
    const ImageSize need{ceil_div(full.height * c->size().height, box[2]),
                         ceil_div(full.width * c->size().width, box[3])};
    x = decode_image(bytes, name, need);
    const double fy = static_cast<double>(x.size(1)) / static_cast<double>(full.height);
    const double fx = static_cast<double>(x.size(2)) / static_cast<double>(full.width);
    const int64_t top = static_cast<int64_t>(std::floor(static_cast<double>(box[0]) * fy));
    const int64_t left = static_cast<int64_t>(std::floor(static_cast<double>(box[1]) * fx));
    const int64_t h = std::max<int64_t>(
        1, std::min(x.size(1) - top, round_half_even(static_cast<double>(box[2]) * fy)));
    const int64_t w = std::max<int64_t>(
        1, std::min(x.size(2) - left, round_half_even(static_cast<double>(box[3]) * fx)));
    x = resize_bilinear(x.slice(1, top, top + h).slice(2, left, left + w), c->size().height,
                        c->size().width);
  } else {
    return transform->apply(decode_image(bytes, name), gen);
  }
  return run_chain(rest, x, gen);
}

}  // namespace transforms
}  // namespace data
}  // namespace paratrain
