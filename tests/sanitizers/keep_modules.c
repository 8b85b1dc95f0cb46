// Preloaded by scripts/sanitize.sh under AddressSanitizer only: dlclose() does nothing, so every
// shared object stays loaded until the process ends.
//
// Why: LeakSanitizer names the modules on an allocation's stack when it reports, at exit. Open
// MPI dlclose()s its components (mca_*.so) in MPI_Finalize, so their long-lived allocations are
// reported from "<unknown module>", which no suppression can name. Kept loaded, they are
// suppressed by module (lsan.supp). Nothing else changes: no component is loaded twice.
#include <dlfcn.h>

int dlclose(void* handle) {
  (void)handle;
  return 0;
}
