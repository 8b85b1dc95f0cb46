#include "paratrain/data/dataset.h"

#include "paratrain/data/image.h"

#include <torch/cuda.h>
#include <torch/torch.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <new>
#include <sstream>

namespace paratrain {
namespace data {

namespace fs = std::filesystem;

// ---- collate ------------------------------------------------------------------------------------

namespace {

// Freed batch buffers, kept for the next batches of the same size. A batch of 64 images at
// 224x224 is 38 MB, above glibc's mmap threshold, so a fresh one is mapped and page-faulted in
// while it is filled: perf showed half of the loader's time there on this machine. Recycled
// buffers keep their pages. Bounded; never destroyed (tensors may outlive any owner).
class BatchBuffers {
 public:
  void* take(size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = free_.find(bytes);
      if (it != free_.end()) {
        void* p = it->second;
        free_.erase(it);
        cached_ -= bytes;
        return p;
      }
    }
    void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (p == nullptr) {
      throw std::bad_alloc();
    }
    return p;
  }
  void give(void* p, size_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (free_.size() < kMaxBuffers && cached_ + bytes <= kMaxBytes) {
      free_.emplace(bytes, p);
      cached_ += bytes;
    } else {
      std::free(p);
    }
  }

 private:
  static constexpr size_t kMaxBuffers = 16;
  static constexpr size_t kMaxBytes = size_t{1} << 30;
  std::mutex mutex_;
  std::multimap<size_t, void*> free_;
  size_t cached_ = 0;
};

BatchBuffers& batch_buffers() {
  static BatchBuffers* buffers = new BatchBuffers();  // leaked on purpose: see above
  return *buffers;
}

torch::Tensor batch_tensor(const std::vector<int64_t>& sizes, torch::ScalarType dtype, bool pin) {
  if (pin) {
    return torch::empty(sizes, torch::TensorOptions(dtype).pinned_memory(true));  // CUDA caches
  }
  int64_t numel = 1;
  for (int64_t s : sizes) {
    numel *= s;
  }
  const size_t bytes = std::max<size_t>(1, static_cast<size_t>(numel) * c10::elementSize(dtype));
  void* p = batch_buffers().take(bytes);
  return torch::from_blob(
      p, sizes, [bytes](void* q) { batch_buffers().give(q, bytes); }, torch::TensorOptions(dtype));
}

// Copies `t` into row `row` of `batch` by memcpy, after checking it matches `first`: no ATen
// kernel, since collation runs in loader threads (see transforms.h).
void copy_row(const torch::Tensor& t, const torch::Tensor& batch, size_t row, const char* what) {
  const auto expect = batch.sizes().slice(1);
  TORCH_CHECK(t.defined(), "collate: sample ", row, " of the batch has no ", what);
  TORCH_CHECK(t.sizes() == expect && t.scalar_type() == batch.scalar_type(),
              "collate: cannot stack sample ", row, " of the batch (", what, " ", t.scalar_type(),
              " ", t.sizes(), ") onto sample 0 (", batch.scalar_type(), " ", expect,
              "); give every sample the same shape, e.g. with Resize and CenterCrop or "
              "RandomResizedCrop");
  torch::Tensor c = t.device().is_cpu() && t.is_contiguous() ? t : t.cpu().contiguous();
  const size_t bytes = static_cast<size_t>(c.numel()) * c.element_size();
  std::memcpy(static_cast<char*>(batch.data_ptr()) + row * bytes, c.data_ptr(), bytes);
}

torch::Tensor rows_like(const torch::Tensor& t, size_t n, bool pin, const char* what) {
  TORCH_CHECK(t.defined(), "collate: sample 0 of the batch has no ", what);
  std::vector<int64_t> sizes{static_cast<int64_t>(n)};
  sizes.insert(sizes.end(), t.sizes().begin(), t.sizes().end());
  return batch_tensor(sizes, t.scalar_type(), pin);
}

}  // namespace

Collator::Collator(size_t capacity, bool pin_memory)
    : capacity_(capacity), pin_(pin_memory && torch::cuda::is_available()) {}

void Collator::add(const Sample& sample) {
  TORCH_CHECK(count_ < capacity_, "collate: more than ", capacity_, " samples");
  if (count_ == 0) {
    batch_.data = rows_like(sample.data, capacity_, pin_, "data");
    batch_.target = rows_like(sample.target, capacity_, pin_, "target");
  }
  copy_row(sample.data, batch_.data, count_, "data");
  copy_row(sample.target, batch_.target, count_, "target");
  ++count_;
}

Batch Collator::finish() {
  Batch out = std::move(batch_);
  if (count_ > 0 && count_ < capacity_) {
    out.data = out.data.narrow(0, 0, static_cast<int64_t>(count_));
    out.target = out.target.narrow(0, 0, static_cast<int64_t>(count_));
  }
  count_ = 0;
  return out;
}

Batch collate(const std::vector<Sample>& samples, bool pin_memory) {
  TORCH_CHECK(!samples.empty(), "collate: no samples");
  Collator c(samples.size(), pin_memory);
  for (const auto& s : samples) {
    c.add(s);
  }
  return c.finish();
}

// ---- TensorDataset ------------------------------------------------------------------------------

TensorDataset::TensorDataset(torch::Tensor data,
                             torch::Tensor targets,
                             transforms::TransformPtr transform)
    : data_(std::move(data)), targets_(std::move(targets)), transform_(std::move(transform)) {
  TORCH_CHECK(data_.dim() >= 1 && targets_.dim() >= 1 && data_.size(0) == targets_.size(0),
              "TensorDataset: ", data_.dim() >= 1 ? data_.size(0) : 0, " samples but ",
              targets_.dim() >= 1 ? targets_.size(0) : 0, " targets (data ", data_.sizes(),
              ", targets ", targets_.sizes(), ")");
}

Sample TensorDataset::get(size_t index) {
  TORCH_CHECK(index < size(), "TensorDataset: index ", index, " out of range for ", size(),
              " samples");
  const auto i = static_cast<int64_t>(index);
  torch::Tensor x = data_[i];
  if (transform_) {
    x = transform_->apply(x, sample_generator());
  }
  return {x, targets_[i]};
}

std::optional<Batch> TensorDataset::get_batch(const std::vector<size_t>& indices) {
  if (transform_) {
    return std::nullopt;
  }
  for (size_t i : indices) {
    TORCH_CHECK(i < size(), "TensorDataset: index ", i, " out of range for ", size(), " samples");
  }
  std::vector<int64_t> pick(indices.begin(), indices.end());
  torch::Tensor idx = torch::tensor(pick, torch::kLong);
  return Batch{data_.index_select(0, idx), targets_.index_select(0, idx)};
}

// ---- image datasets -----------------------------------------------------------------------------

Sample ImageDataset::get(size_t index) {
  TORCH_CHECK(index < samples_.size(), "image dataset: index ", index, " out of range for ",
              samples_.size(), " samples");
  const auto& [path, label] = samples_[index];
  torch::Tensor image = transforms::decode_and_transform(read_file(path), path, transform_.get(),
                                                         sample_generator(), options_.draft());
  return {image, torch::scalar_tensor(label, torch::kLong)};
}

std::string ImageDataset::describe(size_t index) const {
  return index < samples_.size() ? samples_[index].first : std::string();
}

const std::vector<std::string>& image_extensions() {
  static const std::vector<std::string> extensions{".jpg", ".jpeg", ".png",  ".ppm", ".bmp",
                                                   ".pgm", ".tif",  ".tiff", ".webp"};
  return extensions;
}

namespace {

bool has_image_extension(const std::string& name) {
  std::string lower = name;
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  for (const auto& ext : image_extensions()) {
    if (lower.size() >= ext.size() &&
        lower.compare(lower.size() - ext.size(), ext.size(), ext) == 0) {
      return true;
    }
  }
  return false;
}

std::string extension_list() {
  std::string s;
  for (const auto& ext : image_extensions()) {
    s += (s.empty() ? "" : " ") + ext;
  }
  return s;
}

// Files under dir (recursively, following links) with an image extension, in torchvision's
// order: sorted(os.walk(dir)) visits folders by path, each folder's files sorted by name.
std::vector<std::string> image_files(const fs::path& dir) {
  std::vector<std::pair<std::string, std::string>> found;  // (folder, name)
  std::error_code ec;
  fs::recursive_directory_iterator it(dir, fs::directory_options::follow_directory_symlink, ec);
  TORCH_CHECK(!ec, "ImageFolder: cannot list ", dir.string(), ": ", ec.message());
  for (; it != fs::recursive_directory_iterator(); it.increment(ec)) {
    TORCH_CHECK(!ec, "ImageFolder: cannot list ", dir.string(), ": ", ec.message());
    std::error_code type_ec;
    if (it->is_regular_file(type_ec) && has_image_extension(it->path().filename().string())) {
      found.emplace_back(it->path().parent_path().string(), it->path().filename().string());
    }
  }
  std::sort(found.begin(), found.end());
  std::vector<std::string> paths;
  paths.reserve(found.size());
  for (const auto& [folder, name] : found) {
    paths.push_back((fs::path(folder) / name).string());
  }
  return paths;
}

}  // namespace

ImageFolder::ImageFolder(const std::string& root,
                         transforms::TransformPtr transform,
                         ImageDatasetOptions options)
    : ImageDataset(std::move(transform), options), root_(root) {
  std::error_code ec;
  TORCH_CHECK(fs::exists(root, ec), "ImageFolder: root ", root, " does not exist");
  TORCH_CHECK(fs::is_directory(root, ec), "ImageFolder: root ", root, " is not a folder");
  for (fs::directory_iterator it(root, ec), end; !ec && it != end; it.increment(ec)) {
    std::error_code type_ec;
    if (it->is_directory(type_ec)) {
      classes_.push_back(it->path().filename().string());
    }
  }
  TORCH_CHECK(!ec, "ImageFolder: cannot list ", root, ": ", ec.message());
  TORCH_CHECK(!classes_.empty(), "ImageFolder: no class folder in ", root,
              " (expected one subfolder per class: ", root, "/<class>/<image>)");
  std::sort(classes_.begin(), classes_.end());
  for (size_t c = 0; c < classes_.size(); ++c) {
    class_to_idx_[classes_[c]] = static_cast<int64_t>(c);
    const fs::path dir = fs::path(root) / classes_[c];
    const auto files = image_files(dir);
    TORCH_CHECK(!files.empty(), "ImageFolder: class folder ", dir.string(),
                " holds no image (supported extensions: ", extension_list(), ")");
    for (const auto& f : files) {
      samples_.emplace_back(f, static_cast<int64_t>(c));
    }
  }
}

ImageList::ImageList(const std::string& list_file,
                     transforms::TransformPtr transform,
                     std::string root,
                     ImageDatasetOptions options)
    : ImageDataset(std::move(transform), options) {
  std::ifstream in(list_file);
  TORCH_CHECK(in.good(), "ImageList: cannot read ", list_file, ": ", std::strerror(errno));
  const fs::path base = root.empty() ? fs::path(list_file).parent_path() : fs::path(root);
  std::string line;
  for (size_t number = 1; std::getline(in, line); ++number) {
    const size_t first = line.find_first_not_of(" \t\r");
    if (first == std::string::npos || line[first] == '#') {
      continue;
    }
    const size_t last = line.find_last_not_of(" \t\r");
    const std::string text = line.substr(first, last - first + 1);
    const size_t split = text.find_last_of(" \t");
    const std::string label = split == std::string::npos ? "" : text.substr(split + 1);
    const std::string path =
        split == std::string::npos ? "" : text.substr(0, text.find_last_not_of(" \t", split) + 1);
    const bool digits = !label.empty() && label.size() <= 18 &&
                        std::all_of(label.begin(), label.end(),
                                    [](unsigned char ch) { return std::isdigit(ch) != 0; });
    TORCH_CHECK(!path.empty() && digits, "ImageList: ", list_file, " line ", number,
                ": expected '<path> <label>' with a non-negative integer label, got '", text, "'");
    const fs::path p(path);
    samples_.emplace_back((p.is_absolute() ? p : base / p).string(), std::stoll(label));
  }
  TORCH_CHECK(!in.bad(), "ImageList: cannot read ", list_file, ": ", std::strerror(errno));
  TORCH_CHECK(!samples_.empty(), "ImageList: ", list_file, " lists no image");
}

}  // namespace data
}  // namespace paratrain
