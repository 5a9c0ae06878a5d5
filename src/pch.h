// Precompiled header for every Tandem target: the heavy LibTorch headers parsed once.
#pragma once
#include <ATen/ATen.h>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <torch/torch.h>
#include <vector>
