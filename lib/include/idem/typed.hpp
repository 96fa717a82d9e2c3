// idem — typed results: the caller's type round-trips through JSON.
//
//   struct Charge { std::string id; int amount; };
//   NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(Charge, id, amount)
//   idem::Typed<Charge> c = idem::call<Charge>(coordinator, request, [&] { return charge(); });
//
// The value is stored as its JSON (status 200) and a replay parses it back; void actions
// and empty std::optional results store JSON null. Business rejections that need another status use
// Coordinator::call.
#pragma once

#include <nlohmann/json.hpp>
#include <optional>
#include <type_traits>
#include <utility>

#include "idem/coordinator.hpp"

namespace idem {

namespace detail {

template <class T>
struct is_optional : std::false_type {};
template <class U>
struct is_optional<std::optional<U>> : std::true_type {};

template <class T>
nlohmann::json to_json_value(const T& value) {
  if constexpr (is_optional<T>::value) {
    return value ? nlohmann::json(*value) : nlohmann::json(nullptr);
  } else {
    return nlohmann::json(value);
  }
}

template <class T>
T from_json_value(const nlohmann::json& j) {
  if constexpr (is_optional<T>::value) {
    if (j.is_null()) return T{};
    return T{j.template get<typename T::value_type>()};
  } else {
    return j.template get<T>();
  }
}

}  // namespace detail

template <class T>
struct Typed {
  T value;
  Outcome::Source source = Outcome::Source::executed;
  bool replayed() const noexcept { return source == Outcome::Source::replayed; }
};

template <>
struct Typed<void> {
  Outcome::Source source = Outcome::Source::executed;
  bool replayed() const noexcept { return source == Outcome::Source::replayed; }
};

// Coordinator::call for an action returning T (or void). Same errors as call(); a stored
// body that does not parse as T throws nlohmann::json::exception.
template <class T, class F>
Typed<T> call(Coordinator& coordinator, const Request& request, F&& action) {
  Outcome out = coordinator.call(request, [&]() -> Response {
    if constexpr (std::is_void_v<T>) {
      std::forward<F>(action)();
      return Response{200, "null", {}};
    } else {
      return Response{200, detail::to_json_value<T>(std::forward<F>(action)()).dump(), {}};
    }
  });
  if constexpr (std::is_void_v<T>) {
    return Typed<void>{out.source};
  } else {
    return Typed<T>{detail::from_json_value<T>(nlohmann::json::parse(out.response.body)),
                    out.source};
  }
}

}  // namespace idem
