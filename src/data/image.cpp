#include "paratrain/data/image.h"

#include <png.h>
#include <turbojpeg.h>
#include <webp/decode.h>
#include <webp/encode.h>

#include <torch/torch.h>

#include <sys/stat.h>

#include <cerrno>
#include <csetjmp>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>

namespace paratrain {
namespace data {

const char* to_string(ImageFormat format) {
  switch (format) {
    case ImageFormat::kJpeg:
      return "JPEG";
    case ImageFormat::kPng:
      return "PNG";
    case ImageFormat::kWebp:
      return "WebP";
    default:
      return "unknown";
  }
}

ImageFormat sniff_image_format(const void* data, size_t size) {
  const auto* b = static_cast<const unsigned char*>(data);
  if (size >= 3 && b[0] == 0xFF && b[1] == 0xD8 && b[2] == 0xFF) {
    return ImageFormat::kJpeg;
  }
  if (size >= 8 && std::memcmp(b, "\x89PNG\r\n\x1a\n", 8) == 0) {
    return ImageFormat::kPng;
  }
  if (size >= 12 && std::memcmp(b, "RIFF", 4) == 0 && std::memcmp(b + 8, "WEBP", 4) == 0) {
    return ImageFormat::kWebp;
  }
  return ImageFormat::kUnknown;
}

namespace {

// [H, W, C] to [C, H, W] by hand: decoding runs in loader threads, where ATen's copy kernel would
// start an OpenMP team per image.
torch::Tensor to_chw(const torch::Tensor& hwc) {
  const int64_t h = hwc.size(0), w = hwc.size(1), c = hwc.size(2);
  torch::Tensor chw = torch::empty({c, h, w}, torch::kUInt8);
  const uint8_t* in = hwc.data_ptr<uint8_t>();
  uint8_t* out = chw.data_ptr<uint8_t>();
  const int64_t plane = h * w;
  for (int64_t p = 0; p < plane; ++p) {
    for (int64_t k = 0; k < c; ++k) {
      out[k * plane + p] = in[p * c + k];
    }
  }
  return chw;
}

[[noreturn]] void fail(const std::string& name, const std::string& why) {
  TORCH_CHECK(false, "cannot decode ", name, ": ", why);
}

// PIL's decompression-bomb limit (2 x Image.MAX_IMAGE_PIXELS, where PIL raises rather than
// warns): a corrupt or hostile header must not make us allocate gigabytes.
constexpr int64_t kMaxPixels = 2 * int64_t{89478485};

bool too_large(int64_t height, int64_t width) {
  return height <= 0 || width <= 0 || height > kMaxPixels / width;
}

std::string size_text(int64_t height, int64_t width) {
  return std::to_string(height) + "x" + std::to_string(width);
}

ImageFormat known_format(const std::string& bytes, const std::string& name) {
  ImageFormat format = sniff_image_format(bytes.data(), bytes.size());
  if (format == ImageFormat::kUnknown) {
    fail(name, bytes.empty() ? "the file is empty"
                             : "not a JPEG, PNG or WebP file (paratrain decodes these three)");
  }
  return format;
}

// ---- JPEG (TurboJPEG) ---------------------------------------------------------------------------

// One decompressor per thread: a TurboJPEG handle must not be used by two threads at once, and
// making one per image would cost an allocation of libjpeg's state each time.
struct TjHandle {
  tjhandle handle = nullptr;
  explicit TjHandle(bool compress) : handle(compress ? tjInitCompress() : tjInitDecompress()) {
    TORCH_CHECK(handle != nullptr, "TurboJPEG: cannot create a handle: ", tjGetErrorStr2(nullptr));
  }
  ~TjHandle() { tjDestroy(handle); }
};

thread_local std::unique_ptr<TjHandle> tls_decompressor;

tjhandle decompressor() {
  if (!tls_decompressor) {
    tls_decompressor = std::make_unique<TjHandle>(false);
  }
  return tls_decompressor->handle;
}

// After an error a TurboJPEG 2.1 handle can report a zero size for the next good file (seen with
// a header cut short, then a valid JPEG), so a failed handle is replaced, never reused.
[[noreturn]] void fail_jpeg(const std::string& name, const std::string& why) {
  tls_decompressor.reset();
  fail(name, why);
}

struct JpegHeader {
  int width = 0, height = 0, subsamp = 0, colorspace = 0;
};

JpegHeader jpeg_header(const std::string& bytes, const std::string& name) {
  JpegHeader h;
  tjhandle tj = decompressor();
  if (tjDecompressHeader3(tj, reinterpret_cast<const unsigned char*>(bytes.data()),
                          static_cast<unsigned long>(bytes.size()), &h.width, &h.height, &h.subsamp,
                          &h.colorspace) != 0) {
    const std::string why = tjGetErrorStr2(tj);
    fail_jpeg(name, "JPEG header: " + why + (bytes.size() < 1024 ? " (truncated?)" : ""));
  }
  if (too_large(h.height, h.width)) {
    fail_jpeg(name, "JPEG header: image size " + size_text(h.height, h.width) +
                        " (HxW) is empty or above the limit of " + std::to_string(kMaxPixels) +
                        " pixels");
  }
  return h;
}

// The smallest scaling factor <= 1 whose scaled size still covers at_least (1 when at_least is
// unset or nothing smaller fits).
tjscalingfactor pick_scale(const JpegHeader& h, ImageSize at_least) {
  tjscalingfactor best{1, 1};
  if (at_least.height <= 0 && at_least.width <= 0) {
    return best;
  }
  int n = 0;
  tjscalingfactor* factors = tjGetScalingFactors(&n);
  for (int i = 0; i < n; ++i) {
    const tjscalingfactor f = factors[i];
    if (f.num > f.denom || f.num * best.denom >= best.num * f.denom) {
      continue;  // larger than 1, or not smaller than the best so far
    }
    if (TJSCALED(h.width, f) >= at_least.width && TJSCALED(h.height, f) >= at_least.height) {
      best = f;
    }
  }
  return best;
}

// PIL reads CMYK JPEGs as Adobe's inverted CMYK ("CMYK;I") and converts to RGB with
// R = K' - K' * C' / 255 on the inverted values; this is that arithmetic on the stored values,
// with PIL's rounding of the product, so the result matches Image.convert("RGB").
void cmyk_to_rgb(const unsigned char* cmyk, unsigned char* rgb, int64_t pixels) {
  for (int64_t p = 0; p < pixels; ++p) {
    const int k = cmyk[4 * p + 3];  // 255 - PIL's K
    for (int c = 0; c < 3; ++c) {
      const int tmp = (255 - cmyk[4 * p + c]) * k + 128;
      const int v = k - (((tmp >> 8) + tmp) >> 8);
      rgb[3 * p + c] = static_cast<unsigned char>(v < 0 ? 0 : v);
    }
  }
}

torch::Tensor decode_jpeg(const std::string& bytes, const std::string& name, ImageSize at_least) {
  const JpegHeader h = jpeg_header(bytes, name);
  const tjscalingfactor f = pick_scale(h, at_least);
  const int width = TJSCALED(h.width, f);
  const int height = TJSCALED(h.height, f);
  const bool cmyk = h.colorspace == TJCS_CMYK || h.colorspace == TJCS_YCCK;
  const int pixel_format = cmyk ? TJPF_CMYK : TJPF_RGB;
  const int channels = cmyk ? 4 : 3;
  torch::Tensor hwc = torch::empty({height, width, channels}, torch::kUInt8);
  tjhandle tj = decompressor();
  // libjpeg warns, and fills the rest with gray, when data ends early; PIL refuses such a file
  // ("image file is truncated"), so a premature end is an error here too. Other warnings (extra
  // bytes between markers, which real photo collections have) are ignored, as PIL ignores them.
  if (tjDecompress2(tj, reinterpret_cast<const unsigned char*>(bytes.data()),
                    static_cast<unsigned long>(bytes.size()), hwc.data_ptr<uint8_t>(), width, 0,
                    height, pixel_format, 0) != 0) {
    const std::string why = tjGetErrorStr2(tj);
    if (tjGetErrorCode(tj) == TJERR_FATAL || why.find("Premature end") != std::string::npos) {
      fail_jpeg(name,
                (why.find("Premature end") != std::string::npos ? "truncated JPEG (" : "JPEG (") +
                    why + ")");
    }
  }
  if (cmyk) {
    torch::Tensor rgb = torch::empty({height, width, 3}, torch::kUInt8);
    cmyk_to_rgb(hwc.data_ptr<uint8_t>(), rgb.data_ptr<uint8_t>(), int64_t{height} * width);
    hwc = rgb;
  }
  return to_chw(hwc);
}

// ---- PNG (libpng) -------------------------------------------------------------------------------

struct PngSource {
  const unsigned char* data;
  size_t size;
  size_t pos;
  char error[256];
};

void png_read_bytes(png_structp png, png_bytep out, png_size_t n) {
  auto* src = static_cast<PngSource*>(png_get_io_ptr(png));
  if (n > src->size - src->pos) {
    png_error(png, "truncated PNG (the file ends early)");
  }
  std::memcpy(out, src->data + src->pos, n);
  src->pos += n;
}

void png_fail(png_structp png, png_const_charp message) {
  auto* src = static_cast<PngSource*>(png_get_error_ptr(png));
  std::snprintf(src->error, sizeof src->error, "%s", message);
  png_longjmp(png, 1);
}

void png_warn(png_structp, png_const_charp) {}

// libpng reports errors by longjmp, so this function holds no object with a destructor between
// setjmp and the calls that may jump; the caller owns `out` (malloc'd). Returns false with
// src->error set on failure. The transforms give what PIL's convert("RGB") gives: palette and
// low-bit gray expanded, gray replicated, alpha dropped; 16-bit samples keep their high byte
// (PIL does so for 16-bit RGB; for 16-bit gray, which it opens as "I;16", it clips instead).
bool png_decode_raw(PngSource* src, unsigned char** out, png_uint_32* width, png_uint_32* height) {
  png_structp png = png_create_read_struct(PNG_LIBPNG_VER_STRING, src, png_fail, png_warn);
  if (png == nullptr) {
    std::snprintf(src->error, sizeof src->error, "out of memory");
    return false;
  }
  png_infop info = png_create_info_struct(png);
  if (info == nullptr) {
    png_destroy_read_struct(&png, nullptr, nullptr);
    std::snprintf(src->error, sizeof src->error, "out of memory");
    return false;
  }
  unsigned char* volatile pixels = nullptr;
  png_bytep* volatile rows = nullptr;
  if (setjmp(png_jmpbuf(png))) {
    std::free(pixels);
    std::free(rows);
    png_destroy_read_struct(&png, &info, nullptr);
    if (src->error[0] == '\0') {
      std::snprintf(src->error, sizeof src->error, "out of memory");
    }
    return false;
  }
  png_set_read_fn(png, src, png_read_bytes);
  png_read_info(png, info);
  const png_uint_32 w = png_get_image_width(png, info);
  const png_uint_32 h = png_get_image_height(png, info);
  if (too_large(h, w)) {
    png_error(png, "image size above the limit of 178956970 pixels");
  }
  png_set_expand(png);
  png_set_strip_16(png);
  png_set_strip_alpha(png);
  png_set_gray_to_rgb(png);
  png_set_interlace_handling(png);
  png_read_update_info(png, info);
  if (png_get_rowbytes(png, info) != size_t{w} * 3) {
    png_error(png, "unexpected PNG layout after conversion to RGB");
  }
  pixels = static_cast<unsigned char*>(std::malloc(size_t{w} * h * 3));
  rows = static_cast<png_bytep*>(std::malloc(sizeof(png_bytep) * h));
  if (pixels == nullptr || rows == nullptr) {
    png_error(png, "out of memory");
  }
  for (png_uint_32 y = 0; y < h; ++y) {
    rows[y] = pixels + size_t{y} * w * 3;
  }
  png_read_image(png, rows);
  // No png_read_end: chunks after the pixels (or a missing IEND) do not matter, as with PIL.
  std::free(rows);
  png_destroy_read_struct(&png, &info, nullptr);
  *out = pixels;
  *width = w;
  *height = h;
  return true;
}

torch::Tensor decode_png(const std::string& bytes, const std::string& name) {
  PngSource src{reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size(), 0, {0}};
  unsigned char* pixels = nullptr;
  png_uint_32 w = 0, h = 0;
  if (!png_decode_raw(&src, &pixels, &w, &h)) {
    fail(name, std::string("PNG: ") + src.error);
  }
  auto hwc = torch::from_blob(
      pixels, {static_cast<int64_t>(h), static_cast<int64_t>(w), 3}, [](void* p) { std::free(p); },
      torch::kUInt8);
  return to_chw(hwc);
}

// ---- WebP (libwebp) -----------------------------------------------------------------------------

torch::Tensor decode_webp(const std::string& bytes, const std::string& name) {
  int w = 0, h = 0;
  if (!WebPGetInfo(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), &w, &h)) {
    fail(name, "corrupt or truncated WebP");
  }
  if (too_large(h, w)) {
    fail(name, "WebP image size " + size_text(h, w) + " (HxW) is above the limit");
  }
  uint8_t* rgb =
      WebPDecodeRGB(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), &w, &h);
  if (rgb == nullptr) {
    fail(name, "corrupt or truncated WebP");
  }
  auto hwc = torch::from_blob(
      rgb, {h, w, 3}, [](void* p) { WebPFree(p); }, torch::kUInt8);
  return to_chw(hwc);
}

}  // namespace

ImageSize read_image_size(const std::string& bytes, const std::string& name) {
  switch (known_format(bytes, name)) {
    case ImageFormat::kJpeg: {
      const JpegHeader h = jpeg_header(bytes, name);
      return {h.height, h.width};
    }
    case ImageFormat::kPng: {
      // IHDR is the first chunk: width and height are big-endian at bytes 16..23.
      if (bytes.size() < 24 || bytes.compare(12, 4, "IHDR") != 0) {
        fail(name, "PNG: no IHDR chunk");
      }
      auto be32 = [&](size_t at) {
        const auto* b = reinterpret_cast<const unsigned char*>(bytes.data()) + at;
        return (int64_t{b[0]} << 24) | (int64_t{b[1]} << 16) | (int64_t{b[2]} << 8) | b[3];
      };
      if (too_large(be32(20), be32(16))) {
        fail(name, "PNG image size " + size_text(be32(20), be32(16)) +
                       " (HxW) is empty or above the limit of " + std::to_string(kMaxPixels) +
                       " pixels");
      }
      return {be32(20), be32(16)};
    }
    default: {
      int w = 0, h = 0;
      if (!WebPGetInfo(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), &w, &h)) {
        fail(name, "WebP: bad header");
      }
      return {h, w};
    }
  }
}

torch::Tensor decode_image(const std::string& bytes, const std::string& name, ImageSize at_least) {
  switch (known_format(bytes, name)) {
    case ImageFormat::kJpeg:
      return decode_jpeg(bytes, name, at_least);
    case ImageFormat::kPng:
      return decode_png(bytes, name);
    default:
      return decode_webp(bytes, name);
  }
}

std::string read_file(const std::string& path) {
  // A folder opens as a stream and reads as empty: say what it is instead.
  struct stat st {};
  TORCH_CHECK(::stat(path.c_str(), &st) != 0 || !S_ISDIR(st.st_mode), "cannot read ", path,
              ": it is a folder, not an image file");
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    TORCH_CHECK(false, "cannot read ", path, ": ", std::strerror(errno));
  }
  std::ostringstream buffer;
  buffer << in.rdbuf();
  if (in.bad()) {
    TORCH_CHECK(false, "cannot read ", path, ": ", std::strerror(errno));
  }
  return buffer.str();
}

torch::Tensor read_image(const std::string& path, ImageSize at_least) {
  return decode_image(read_file(path), path, at_least);
}

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  out.close();
  TORCH_CHECK(out.good(), "cannot write ", path, ": ", std::strerror(errno));
}

// ---- encoders -----------------------------------------------------------------------------------

namespace {

// [C, H, W] (or [H, W]) uint8 to contiguous [H, W, C].
torch::Tensor to_hwc(const torch::Tensor& image, const char* what) {
  TORCH_CHECK(image.scalar_type() == torch::kUInt8 && (image.dim() == 2 || image.dim() == 3), what,
              ": expected a uint8 image [C, H, W] or [H, W], got ", image.scalar_type(), " ",
              image.sizes());
  torch::Tensor chw = image.dim() == 2 ? image.unsqueeze(0) : image;
  TORCH_CHECK(chw.size(1) > 0 && chw.size(2) > 0, what, ": empty image ", image.sizes());
  return chw.permute({1, 2, 0}).contiguous().cpu();
}

}  // namespace

std::string encode_jpeg(const torch::Tensor& image, int quality) {
  torch::Tensor hwc = to_hwc(image, "encode_jpeg");
  const int64_t c = hwc.size(2);
  TORCH_CHECK(c == 1 || c == 3 || c == 4, "encode_jpeg: 1, 3 or 4 (CMYK) channels, got ", c);
  TORCH_CHECK(quality >= 1 && quality <= 100, "encode_jpeg: quality must be in 1..100, got ",
              quality);
  thread_local TjHandle h(true);
  const int format = c == 1 ? TJPF_GRAY : c == 3 ? TJPF_RGB : TJPF_CMYK;
  const int subsamp = c == 1 ? TJSAMP_GRAY : TJSAMP_420;
  unsigned char* out = nullptr;
  unsigned long size = 0;
  if (tjCompress2(h.handle, hwc.data_ptr<uint8_t>(), static_cast<int>(hwc.size(1)), 0,
                  static_cast<int>(hwc.size(0)), format, &out, &size, subsamp, quality, 0) != 0) {
    tjFree(out);
    TORCH_CHECK(false, "encode_jpeg: ", tjGetErrorStr2(h.handle));
  }
  std::string bytes(reinterpret_cast<const char*>(out), size);
  tjFree(out);
  return bytes;
}

std::string encode_png(const torch::Tensor& image) {
  torch::Tensor hwc = to_hwc(image, "encode_png");
  const int64_t c = hwc.size(2);
  TORCH_CHECK(c >= 1 && c <= 4, "encode_png: 1 to 4 channels, got ", c);
  png_image png;
  std::memset(&png, 0, sizeof png);
  png.version = PNG_IMAGE_VERSION;
  png.width = static_cast<png_uint_32>(hwc.size(1));
  png.height = static_cast<png_uint_32>(hwc.size(0));
  png.format = c == 1   ? PNG_FORMAT_GRAY
               : c == 2 ? PNG_FORMAT_GA
               : c == 3 ? PNG_FORMAT_RGB
                        : PNG_FORMAT_RGBA;
  png_alloc_size_t size = 0;
  TORCH_CHECK(png_image_write_get_memory_size(png, size, 0, hwc.data_ptr<uint8_t>(), 0, nullptr),
              "encode_png: ", png.message);
  std::string bytes(size, '\0');
  TORCH_CHECK(
      png_image_write_to_memory(&png, bytes.data(), &size, 0, hwc.data_ptr<uint8_t>(), 0, nullptr),
      "encode_png: ", png.message);
  bytes.resize(size);
  return bytes;
}

std::string encode_webp(const torch::Tensor& image) {
  torch::Tensor hwc = to_hwc(image, "encode_webp");
  const int64_t c = hwc.size(2);
  TORCH_CHECK(c == 3 || c == 4, "encode_webp: 3 or 4 channels, got ", c);
  uint8_t* out = nullptr;
  const int w = static_cast<int>(hwc.size(1));
  const int h = static_cast<int>(hwc.size(0));
  const size_t size = c == 3 ? WebPEncodeLosslessRGB(hwc.data_ptr<uint8_t>(), w, h, w * 3, &out)
                             : WebPEncodeLosslessRGBA(hwc.data_ptr<uint8_t>(), w, h, w * 4, &out);
  TORCH_CHECK(size > 0, "encode_webp: libwebp failed on a ", h, "x", w, " image");
  std::string bytes(reinterpret_cast<const char*>(out), size);
  WebPFree(out);
  return bytes;
}

}  // namespace data
}  // namespace paratrain
