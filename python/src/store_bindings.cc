// Bindings for rendezvous stores (include/strata/comm/store.h): the opaque
// strata._Store, the file store, and the adapter over a Python store object
// (python/strata/store.py wraps torch.distributed's TCPStore, what torchrun
// provides at MASTER_ADDR:MASTER_PORT, in one).
//
// The adapter calls back into Python from whatever thread the backend
// bootstraps on, so every callback takes the GIL; the Python objects it
// holds are released under the GIL too (the store may be dropped by a
// communicator destroyed with the GIL released).
#include <pybind11/stl.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "registry.h"
#include "status_map.h"
#include "store_handle.h"
#include "strata/comm/backend.h"
#include "strata/comm/store.h"

namespace py = pybind11;

namespace strata::bindings {
namespace {

// A Python object that may be released without the GIL held.
std::shared_ptr<py::object> HoldWithGil(py::object obj) {
  return std::shared_ptr<py::object>(new py::object(std::move(obj)), [](py::object* p) {
    if (!Py_IsInitialized()) {
      // Interpreter gone (a store kept past exit): the object goes with it.
      p->release();
      delete p;
      return;
    }
    py::gil_scoped_acquire gil;
    delete p;
  });
}

// Seconds until `deadline`; <= 0 when it has passed.
double Remaining(absl::Time deadline) {
  if (deadline == absl::InfiniteFuture()) return 1e9;
  return absl::ToDoubleSeconds(deadline - absl::Now());
}

// The Python adapter raises TimeoutError when a deadline passes and
// LookupError when a key is absent; everything else means the store could
// not be reached or failed.
absl::Status FromPython(py::error_already_set& e, absl::string_view what,
                        const std::string& store) {
  // The exception's own text, without the traceback e.what() appends.
  const std::string message = absl::StrCat(what, " on ", store, ": ",
                                           py::str(e.type().attr("__name__")).cast<std::string>(),
                                           ": ", py::str(e.value()).cast<std::string>());
  if (e.matches(PyExc_TimeoutError)) return absl::DeadlineExceededError(message);
  if (e.matches(PyExc_LookupError)) return absl::NotFoundError(message);
  if (e.matches(PyExc_ValueError)) return absl::InvalidArgumentError(message);
  return absl::UnavailableError(message);
}

absl::StatusOr<std::shared_ptr<Store>> AdaptPythonStore(py::object adapter) {
  const std::string describe = py::str(adapter.attr("describe")()).cast<std::string>();
  std::shared_ptr<py::object> a = HoldWithGil(std::move(adapter));
  StoreCallbacks cb;
  cb.describe = describe;
  cb.set = [a, describe](absl::string_view key, absl::string_view value,
                         absl::Time deadline) -> absl::Status {
    py::gil_scoped_acquire gil;
    try {
      a->attr("set")(py::str(key.data(), key.size()), py::bytes(value.data(), value.size()),
                     Remaining(deadline));
      return absl::OkStatus();
    } catch (py::error_already_set& e) {
      return FromPython(e, absl::StrCat("set '", key, "'"), describe);
    }
  };
  cb.get = [a, describe](absl::string_view key,
                         absl::Time deadline) -> absl::StatusOr<std::string> {
    py::gil_scoped_acquire gil;
    try {
      return a->attr("get")(py::str(key.data(), key.size()), Remaining(deadline))
          .cast<std::string>();
    } catch (py::error_already_set& e) {
      return FromPython(e, absl::StrCat("get '", key, "'"), describe);
    }
  };
  cb.wait = [a, describe](absl::Span<const std::string> keys, absl::Time deadline) -> absl::Status {
    py::gil_scoped_acquire gil;
    try {
      py::list list;
      for (const std::string& k : keys) list.append(py::str(k));
      a->attr("wait")(list, Remaining(deadline));
      return absl::OkStatus();
    } catch (py::error_already_set& e) {
      return FromPython(e, absl::StrCat("wait for ", keys.size(), " key(s)"), describe);
    }
  };
  cb.add = [a, describe](absl::string_view key, int64_t delta,
                         absl::Time deadline) -> absl::StatusOr<int64_t> {
    py::gil_scoped_acquire gil;
    try {
      return a->attr("add")(py::str(key.data(), key.size()), delta, Remaining(deadline))
          .cast<int64_t>();
    } catch (py::error_already_set& e) {
      return FromPython(e, absl::StrCat("add to '", key, "'"), describe);
    }
  };
  cb.compare_set = [a, describe](absl::string_view key, absl::string_view expected,
                                 absl::string_view desired,
                                 absl::Time deadline) -> absl::StatusOr<std::string> {
    py::gil_scoped_acquire gil;
    try {
      return a
          ->attr("compare_set")(py::str(key.data(), key.size()),
                                py::bytes(expected.data(), expected.size()),
                                py::bytes(desired.data(), desired.size()), Remaining(deadline))
          .cast<std::string>();
    } catch (py::error_already_set& e) {
      return FromPython(e, absl::StrCat("compare_set '", key, "'"), describe);
    }
  };
  return MakeCallbackStore(std::move(cb));
}

absl::Time DeadlineIn(std::optional<double> timeout) {
  return timeout ? absl::Now() + absl::Seconds(*timeout) : absl::InfiniteFuture();
}

template <typename T>
T UnwrapStore(absl::StatusOr<T> v) {
  return Unwrap(std::move(v), ErrorArea::kComm);
}

Registration reg(kOrderComm, [](py::module_& m) {
  using T = std::optional<double>;
  py::class_<PyStore>(m, "_Store")
      .def("describe", [](const PyStore& s) { return s.store->Describe(); })
      .def(
          "set",
          [](PyStore& s, const std::string& key, const std::string& value, T timeout) {
            absl::Status st;
            {
              py::gil_scoped_release release;
              st = s.store->Set(key, value, DeadlineIn(timeout));
            }
            if (!st.ok()) RaiseStatus(st, ErrorArea::kComm);
          },
          py::arg("key"), py::arg("value"), py::arg("timeout") = py::none())
      .def(
          "get",
          [](PyStore& s, const std::string& key, T timeout) {
            absl::StatusOr<std::string> v;
            {
              py::gil_scoped_release release;
              v = s.store->Get(key, DeadlineIn(timeout));
            }
            return py::bytes(UnwrapStore(std::move(v)));
          },
          py::arg("key"), py::arg("timeout") = py::none())
      .def(
          "wait",
          [](PyStore& s, const std::vector<std::string>& keys, T timeout) {
            absl::Status st;
            {
              py::gil_scoped_release release;
              st = s.store->Wait(keys, DeadlineIn(timeout));
            }
            if (!st.ok()) RaiseStatus(st, ErrorArea::kComm);
          },
          py::arg("keys"), py::arg("timeout") = py::none())
      .def(
          "add",
          [](PyStore& s, const std::string& key, int64_t delta, T timeout) {
            absl::StatusOr<int64_t> v;
            {
              py::gil_scoped_release release;
              v = s.store->Add(key, delta, DeadlineIn(timeout));
            }
            return UnwrapStore(std::move(v));
          },
          py::arg("key"), py::arg("delta"), py::arg("timeout") = py::none())
      .def(
          "compare_set",
          [](PyStore& s, const std::string& key, const std::string& expected,
             const std::string& desired, T timeout) {
            absl::StatusOr<std::string> v;
            {
              py::gil_scoped_release release;
              v = s.store->CompareSet(key, expected, desired, DeadlineIn(timeout));
            }
            return py::bytes(UnwrapStore(std::move(v)));
          },
          py::arg("key"), py::arg("expected"), py::arg("desired"), py::arg("timeout") = py::none())
      .def("__repr__",
           [](const PyStore& s) { return "<strata.Store " + s.store->Describe() + ">"; });

  m.def(
      "_file_store",
      [](const std::string& path, double max_poll, double min_poll) {
        FileStoreOptions options;
        options.path = path;
        if (!(max_poll > 0) || max_poll > 10 || !(min_poll > 0) || min_poll > max_poll) {
          RaiseStatus(absl::InvalidArgumentError(absl::StrCat(
                          "file_store: max_poll must be in (0, 10] seconds and min_poll in (0, "
                          "max_poll], got max_poll ",
                          max_poll, " and min_poll ", min_poll)),
                      ErrorArea::kComm);
        }
        options.max_poll = absl::Seconds(max_poll);
        options.min_poll = absl::Seconds(min_poll);
        return PyStore{UnwrapStore(OpenFileStore(options))};
      },
      py::arg("path"), py::arg("max_poll") = 0.02, py::arg("min_poll") = 0.0005,
      "A store kept in a directory every rank sees.");
  m.def(
      "_tcp_store",
      [](const std::string& host, int port, double timeout, const std::string& prefix) {
        TcpStoreOptions options;
        options.host = host;
        options.port = port;
        options.connect_timeout = absl::Seconds(timeout);
        options.prefix = prefix;
        absl::StatusOr<std::shared_ptr<Store>> store;
        {
          py::gil_scoped_release release;
          store = ConnectTcpStore(options);
        }
        return PyStore{UnwrapStore(std::move(store))};
      },
      py::arg("host"), py::arg("port"), py::arg("timeout") = 60.0, py::arg("prefix") = "strata/",
      "A client of a torch.distributed TCPStore server, without Python in its operations.");
  m.def(
      "_python_store",
      [](py::object adapter) { return PyStore{UnwrapStore(AdaptPythonStore(std::move(adapter)))}; },
      py::arg("adapter"),
      "A store whose operations call adapter.set/get/wait/add/compare_set(..., seconds_left) "
      "and adapter.describe() (python/strata/store.py).");
});

}  // namespace
}  // namespace strata::bindings
