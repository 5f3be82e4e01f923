// What the C++ side uses of torch: the LibTorch stable ABI (torch/csrc/stable, targeting 2.10, so
// one binary loads in every torch from 2.10 on), plus what it lacks, written here: shapes and
// devices formatted for error messages, a dtype switch over the activation types, views and
// allocation straight through the C shim, any other ATen op through the dispatcher.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>
#include <torch/headeronly/util/HeaderOnlyArrayRef.h>

namespace qspec_ext {

using Tensor = torch::stable::Tensor;
using TensorList = std::vector<Tensor>;
using ScalarType = torch::headeronly::ScalarType;
using DeviceType = torch::headeronly::DeviceType;
using IntList = torch::headeronly::IntHeaderOnlyArrayRef;
constexpr ScalarType kFloat = ScalarType::Float, kHalf = ScalarType::Half, kBFloat16 = ScalarType::BFloat16,
                     kInt = ScalarType::Int, kLong = ScalarType::Long, kBool = ScalarType::Bool,
                     kByte = ScalarType::Byte;

// Message pieces as torch prints them: shapes "[2, 8]", devices "cpu" / "cuda:0" (dtypes print "Float").
inline std::ostream& operator<<(std::ostream& os, IntList dims) {
  os << '[';
  for (size_t i = 0; i < dims.size(); ++i) os << (i ? ", " : "") << dims[i];
  return os << ']';
}
inline std::ostream& operator<<(std::ostream& os, const torch::stable::Device& device) {
  if (device.is_cpu()) return os << "cpu";
  os << (device.is_cuda() ? "cuda" : "device");
  return device.has_index() ? os << ':' << static_cast<int>(device.index()) : os;
}

template <typename... Args>
std::string concat(const Args&... args) {
  std::ostringstream os;
  ((os << args), ...);
  return std::move(os).str();
}

}  // namespace qspec_ext

// A RuntimeError in Python: "qspec_ext.<op>: argument '<arg>' <what was expected>, got <what came>".
#define QSPEC_CHECK(cond, op, arg, ...)                                                        \
  do {                                                                                         \
    if (!(cond)) [[unlikely]]                                                                  \
      throw std::runtime_error(                                                                \
          ::qspec_ext::concat("qspec_ext.", op, ": argument '", arg, "' ", __VA_ARGS__));       \
  } while (0)

// Dispatch over the activation dtypes (fp32, fp16, bf16); binds scalar_t. NAME names the caller.
#define QSPEC_DISPATCH_ACTIVATION(TYPE, NAME, ...)                                                    \
  [&] {                                                                                               \
    switch (TYPE) {                                                                                   \
      case ::qspec_ext::kFloat: {                                                                     \
        using scalar_t = float;                                                                       \
        return __VA_ARGS__();                                                                         \
      }                                                                                               \
      case ::qspec_ext::kHalf: {                                                                      \
        using scalar_t = c10::Half;                                                                   \
        return __VA_ARGS__();                                                                         \
      }                                                                                               \
      case ::qspec_ext::kBFloat16: {                                                                  \
        using scalar_t = c10::BFloat16;                                                               \
        return __VA_ARGS__();                                                                         \
      }                                                                                               \
      default:                                                                                        \
        throw std::runtime_error(::qspec_ext::concat(NAME, ": unexpected dtype ", TYPE));             \
    }                                                                                                 \
  }()

namespace qspec_ext {

// An ATen op the stable ABI has no wrapper for, through the dispatcher: args in, its one output back.
template <typename... Args>
Tensor call_aten(const char* name, const char* overload, const Args&... args) {
  std::array<StableIValue, sizeof...(Args)> stack{torch::stable::detail::from(args)...};
  STABLE_TORCH_ERROR_CODE_CHECK(torch_call_dispatcher(name, overload, stack.data(), TORCH_ABI_VERSION));
  return torch::stable::detail::to<Tensor>(stack[0]);
}

// Tensor::scalar_type() maps the shim's dtype code through a chain of shim calls, and the typed
// data pointers call it for their check: the entry points call these instead (the checks have
// validated every dtype before a pointer is taken).
inline ScalarType dtype_of(const Tensor& t) {
  static const int32_t f32 = aoti_torch_dtype_float32(), f16 = aoti_torch_dtype_float16(),
                       bf16 = aoti_torch_dtype_bfloat16(), i32 = aoti_torch_dtype_int32(),
                       i64 = aoti_torch_dtype_int64();
  int32_t code = 0;
  STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_get_dtype(t.get(), &code));
  if (code == f32) return kFloat;
  if (code == bf16) return kBFloat16;
  if (code == f16) return kHalf;
  if (code == i64) return kLong;
  if (code == i32) return kInt;
  return t.scalar_type();
}
template <typename T>
const T* const_data(const Tensor& t) {
  return static_cast<const T*>(t.const_data_ptr());
}
template <typename T>
T* mutable_data(const Tensor& t) {
  return static_cast<T*>(t.mutable_data_ptr());
}

// Views, allocation and copies straight through the C shim (a dispatcher call costs about a
// microsecond: these run on every op call).

// A view of t's memory from its first element with these sizes and strides.
inline Tensor as_strided(const Tensor& t, std::vector<int64_t> sizes, std::vector<int64_t> strides) {
  AtenTensorHandle view = nullptr;
  constexpr int64_t kOffsetIncrement = 0;  // added to t's storage offset
  STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch__reinterpret_tensor(t.get(), static_cast<int64_t>(sizes.size()),
                                                               sizes.data(), strides.data(), kOffsetIncrement,
                                                               &view));
  return Tensor(view);
}

// A new contiguous tensor of the given shape with like's dtype (or dtype) and device.
inline Tensor empty(std::vector<int64_t> sizes, const Tensor& like, std::optional<ScalarType> dtype = std::nullopt) {
  std::vector<int64_t> strides(sizes.size());
  int64_t stride = 1;
  for (size_t d = sizes.size(); d-- > 0;) {
    strides[d] = stride;
    stride *= std::max<int64_t>(sizes[d], 1);
  }
  int32_t dtype_code = 0, device_type = 0, device_index = 0;
  if (dtype.has_value())
    dtype_code = torch::stable::detail::to<int32_t>(torch::stable::detail::from(*dtype));
  else
    STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_get_dtype(like.get(), &dtype_code));
  STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_get_device_type(like.get(), &device_type));
  STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_get_device_index(like.get(), &device_index));
  AtenTensorHandle out = nullptr;
  STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_empty_strided(static_cast<int64_t>(sizes.size()), sizes.data(),
                                                         strides.data(), dtype_code, device_type, device_index, &out));
  return Tensor(out);
}
inline Tensor zeros(std::vector<int64_t> sizes, const Tensor& like) {
  Tensor out = empty(std::move(sizes), like);
  STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_zero_(out.get()));
  return out;
}
// t, or a contiguous copy where it is not.
inline Tensor as_contiguous(const Tensor& t) { return t.is_contiguous() ? t : torch::stable::contiguous(t); }

}  // namespace qspec_ext
