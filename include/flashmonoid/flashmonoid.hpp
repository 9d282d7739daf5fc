#pragma once
#include "flashmonoid/attention.hpp"
#include "flashmonoid/error.hpp"
#include "flashmonoid/kvcache.hpp"
#include "flashmonoid/options.hpp"
#include "flashmonoid/tensor.hpp"
