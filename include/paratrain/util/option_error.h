#pragma once

// This header moved to paratrain/base/option_error.h (its code is built into the launcher's
// library, which needs no libtorch). The old name is kept for one release; include the new one.

#include "paratrain/base/option_error.h"
