#pragma once

// Thread settings libtorch's own calls do not cover.

namespace paratrain {

/// Caps the thread pool of the BLAS library under libtorch at `threads`, when it is OpenBLAS
/// (Debian's default; at::set_num_threads does not reach it, and without OMP_NUM_THREADS or
/// OPENBLAS_NUM_THREADS in the environment it starts one spinning thread per core). DataParallel
/// and Pipeline call it for their CPU replicas and stages; call it yourself before running
/// several compute threads of your own. Process-wide; a no-op with other BLAS libraries or
/// threads <= 0.
void set_blas_threads(int threads);

}  // namespace paratrain
