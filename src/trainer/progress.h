#pragma once
#include "tandem/progress.h"  // Progress is a public header: src/trainer and src/text both use it
