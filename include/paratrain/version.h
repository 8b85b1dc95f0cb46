#pragma once

#define PARATRAIN_VERSION "0.1.0"
