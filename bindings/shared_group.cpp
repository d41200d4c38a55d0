// tensortier._core, how the processes of a shared group meet: this process's rank, the world size
// and the store (given, the default process group's, else torchrun's), the group's exit hooks, a
// tensor attached from outside its group, and WholeMemory's call order. The torch.distributed
// stores are made here, on the calling thread, with the GIL held.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <unistd.h>

#include <cctype>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>

#include "arguments.hpp"
#include "register.hpp"
#include "tensortier/util/process_identity.hpp"
#include "tensortier/util/strings.hpp"

namespace py = pybind11;
using namespace tensortier;

namespace {

// An integer from the environment variable `name` (Python's int() of its text), or None.
std::optional<int64_t> EnvInt(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr) return std::nullopt;
  try {
    return py::int_(py::str(value)).cast<int64_t>();
  } catch (const py::error_already_set&) {
    throw py::value_error(
        StrCat("environment variable ", name, "=", PyRepr(value), " is not an integer"));
  }
}

// (rank, world size): those given, else RANK and WORLD_SIZE (torchrun's).
std::pair<int64_t, int64_t> RankAndWorld(std::optional<int64_t> rank,
                                         std::optional<int64_t> world_size) {
  if (!rank) rank = EnvInt("RANK");
  if (!world_size) world_size = EnvInt("WORLD_SIZE");
  if (!rank || !world_size) {
    throw py::value_error(
        "cannot tell this process's rank and the world size: pass rank= and world_size=, "
        "initialise torch.distributed, or start the processes with torchrun (which sets "
        "RANK and WORLD_SIZE)");
  }
  if (*rank < 0 || *rank >= *world_size) {
    throw py::value_error(
        StrCat("rank ", *rank, " is not in a group of ", *world_size, " processes"));
  }
  // The group's ranks are C ints (as torch.distributed's).
  if (*world_size > std::numeric_limits<int>::max()) {
    throw py::value_error(StrCat("world_size ", *world_size, " is more than a group can have (",
                                 std::numeric_limits<int>::max(), ")"));
  }
  return {*rank, *world_size};
}

// torchrun's store: MASTER_ADDR and MASTER_PORT, the key prefix of this restart attempt, and
// whether torchrun's agent serves it rather than rank 0.
struct TorchrunStore {
  std::string host;
  int64_t port = 0;
  std::string prefix;
  bool agent = false;
};

// Whether torchrun's agent (not a rank) serves the job's TCPStore.
bool AgentServesStore() {
  const char* agent = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
  std::string serves = agent == nullptr ? "" : agent;
  for (char& c : serves) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return serves == "true";
}

TorchrunStore TorchrunStoreFromEnv() {
  const char* host = std::getenv("MASTER_ADDR");
  const std::optional<int64_t> port = EnvInt("MASTER_PORT");
  if (host == nullptr || !port) {
    throw py::value_error(
        "no store to meet the other processes: pass store=, initialise torch.distributed, "
        "or set MASTER_ADDR and MASTER_PORT (torchrun does)");
  }
  const char* attempt = std::getenv("TORCHELASTIC_RESTART_COUNT");
  return {host, *port, StrCat("tensortier/attempt_", attempt ? attempt : "0"), AgentServesStore()};
}

// torchrun's TCPStore (served here when `is_master`) under the prefix of this restart attempt,
// and its name for errors: (store, name). ConnectionError quoting the first line of torch's error
// when it cannot be served or reached.
py::tuple EnvStore(bool is_master, std::optional<int64_t> world_size, double timeout_s) {
  const TorchrunStore env = TorchrunStoreFromEnv();
  py::module_ dist = py::module_::import("torch.distributed");
  py::object timeout =
      py::module_::import("datetime").attr("timedelta")(py::arg("seconds") = timeout_s);
  // The TCPStore a process serves, served once: a second group (after close(), or a WholeMemory
  // finalize_lib() and mp_init() again; or two at once) meets through it too, where serving the
  // port again would fail with EADDRINUSE. Groups' keys on one store are their own (numbered by
  // the store). Not across fork(): a child's is its own. Clients connect anew each time (a
  // server restarted since at the same address is reached).
  py::dict stores = py::module_::import("tensortier._core").attr("_env_stores");
  const py::tuple key = py::make_tuple(env.host, env.port, getpid());
  py::object tcp;
  if (is_master && stores.contains(key)) {
    tcp = stores[key];
    tcp.attr("set_timeout")(timeout);  // this group's
  } else {
    try {
      tcp =
          dist.attr("TCPStore")(env.host, env.port, world_size, py::arg("is_master") = is_master,
                                py::arg("timeout") = timeout, py::arg("wait_for_workers") = false);
    } catch (py::error_already_set& e) {
      if (!e.matches(dist.attr("DistNetworkError"))) throw;
      std::string first = py::str(py::str(e.value()).attr("strip")()).cast<std::string>();
      first = first.substr(0, first.find('\n'));
      if (first.empty()) first = py::str(e.type().attr("__name__"));
      char seconds[32];
      std::snprintf(seconds, sizeof seconds, "%g", timeout_s);
      const std::string text =
          StrCat("cannot ", is_master ? "serve " : "reach ", "the TCPStore at ", env.host, ":",
                 env.port, " (MASTER_ADDR:MASTER_PORT)",
                 is_master ? "" : StrCat(" within ", seconds, " s"), ": ", first);
      PyErr_SetString(PyExc_ConnectionError, text.c_str());
      throw py::error_already_set();
    }
    if (is_master) stores[key] = tcp;
  }
  return py::make_tuple(dist.attr("PrefixStore")(env.prefix, tcp),
                        StrCat(env.agent ? "torchrun's agent" : "rank 0",
                               " (which hosts the TCPStore at ", env.host, ":", env.port, ")"));
}

// Whether rank 0 of this job may be the process serving `store`: a TCPStore (under any
// PrefixStores), which init_process_group's env:// rendezvous and most users' own
// TCPStore(is_master=rank == 0) serve on rank 0 — unless torchrun's agent serves it. Rank 0 then
// waits at exit for the others to leave (as when it serves torchrun's store itself), so that a
// rank still reading its last collective's keys does not lose the store under it; where another
// process serves it, the wait only lasts until the others have left.
bool MayHostTcpStore(const py::module_& dist, py::object store) {
  if (AgentServesStore()) return false;
  while (py::isinstance(store, dist.attr("PrefixStore"))) store = store.attr("underlying_store");
  return py::isinstance(store, dist.attr("TCPStore"));
}

// The default process group's store as the group meets through it: where it is the TCPStore at
// MASTER_ADDR:MASTER_PORT (init_process_group's env:// rendezvous), that TCPStore under this
// restart attempt's prefix rather than the default group's own, so that attach() finds the
// tensors by name from outside the job, as for a group made without torch.distributed.
py::object AttachableStore(const py::module_& dist, const py::object& store) {
  py::object inner = store;
  while (py::isinstance(inner, dist.attr("PrefixStore"))) inner = inner.attr("underlying_store");
  if (!py::isinstance(inner, dist.attr("TCPStore")) || std::getenv("MASTER_ADDR") == nullptr) {
    return store;
  }
  const std::optional<int64_t> port = EnvInt("MASTER_PORT");
  if (!port || inner.attr("port").cast<int64_t>() != *port) return store;
  return dist.attr("PrefixStore")(TorchrunStoreFromEnv().prefix, inner);
}

// Calls `fn` of tensortier._core (defined by the other binding files).
py::object Core(const char* fn) {
  return py::module_::import("tensortier._core").attr(fn);
}

}  // namespace

void RegisterSharedGroup(py::module_& m) {
  m.attr("_env_stores") = py::dict();  // the TCPStores EnvStore serves, by (host, port, pid)
  m.def("shared_env_store", &EnvStore, py::arg("is_master"), py::arg("world_size"),
        py::arg("timeout_s"),
        "torchrun's TCPStore (served here when `is_master`) under the key prefix of this restart "
        "attempt, and its name for errors: (store, name). ValueError when MASTER_ADDR and "
        "MASTER_PORT are unset; ConnectionError when it cannot be served or reached.");
  m.def(
      "shared_open_group",
      [](const py::object& rank_arg, const py::object& world_size_arg, py::object store,
         double timeout_s) {
        std::optional<int64_t> rank = OptionalIntArgument(rank_arg, "rank");
        std::optional<int64_t> world_size = OptionalIntArgument(world_size_arg, "world_size");
        py::module_ dist = py::module_::import("torch.distributed");
        const bool initialized =
            dist.attr("is_available")().cast<bool>() && dist.attr("is_initialized")().cast<bool>();
        if (initialized) {
          if (!rank) rank = dist.attr("get_rank")().cast<int64_t>();
          if (!world_size) world_size = dist.attr("get_world_size")().cast<int64_t>();
        }
        const auto [r, world] = RankAndWorld(rank, world_size);
        std::string where;  // empty: SharedTorchStore names the process hosting the store
        bool hosts = false;
        if (store.is_none() && initialized) {
          store = dist.attr("distributed_c10d").attr("_get_default_store")();
          where = "the default process group's store";
          hosts = r == 0 && MayHostTcpStore(dist, store);
          store = AttachableStore(dist, store);
        } else if (!store.is_none()) {
          hosts = r == 0 && MayHostTcpStore(dist, store);
        } else if (world == 1 &&
                   (std::getenv("MASTER_ADDR") == nullptr || !EnvInt("MASTER_PORT"))) {
          // A group of one meets no one (WholeMemory's single-process use, a notebook, a unit
          // test): a store of this process's own. Other processes cannot attach to it by name.
          store = dist.attr("HashStore")();
          where = "this process's own store (a group of one)";
        } else {
          // Under torchrun the agent serves the store; otherwise rank 0 does, as
          // init_process_group.
          hosts = r == 0 && !TorchrunStoreFromEnv().agent;
          py::tuple env = EnvStore(hosts, world, timeout_s);
          store = env[0];
          where = env[1].cast<std::string>();
        }
        py::object adapter = Core("SharedTorchStore")(store, where);  // TypeError for a non-Store
        py::object group = Core("SharedGroup")(adapter, r, world, timeout_s, hosts);
        py::object at_exit = py::module_::import("atexit").attr("register");
        // At this process's exit only: a child made by os.fork() inherits the handlers, and its
        // exit must leave the parent's group (and the store it serves) alone.
        const MakerProcess maker;
        // The other ranks count themselves out on close: a rank serving the store keeps it (held
        // here until exit) until they are done with it (at most the timeout: a dead rank never
        // counts).
        if (hosts) {
          py::object wait = Core("shared_wait_for_leavers");
          py::object leave_key = group.attr("leave_key");
          at_exit(py::cpp_function([maker, wait, adapter, leave_key, world, timeout_s] {
            if (!maker.Forked()) wait(adapter, leave_key, world, timeout_s);
          }));
        }
        if (world > 1) {  // runs before the above (atexit is last in, first out)
          py::object ref = py::module_::import("weakref").attr("ref")(group);
          at_exit(py::cpp_function([maker, ref] {
            if (maker.Forked()) return;
            py::object alive = ref();
            if (!alive.is_none()) alive.attr("close")();
          }));
        }
        return py::make_tuple(group, store, r, world);
      },
      py::arg("rank"), py::arg("world_size"), py::arg("store"), py::arg("timeout_s"),
      "Collective: (SharedGroup, the torch store, rank, world size) of a new group. The rank, "
      "world size and store are those given, else the default process group's, else torchrun's "
      "(its TCPStore served by rank 0 unless torchrun's agent serves it). The group is closed at "
      "exit; the rank serving the store waits then for the others to count themselves out.");
  m.def(
      "shared_attach_outside",
      [](const py::object& name, const py::object& store, const py::object& timeout) {
        if (name.is_none()) throw py::type_error("name must be a str, not NoneType");
        CheckNameArgument(name, "name");
        const auto timeout_s = Core("shared_timeout_s")(timeout).cast<double>();
        py::object torch_store = store;
        std::string where;
        if (store.is_none()) {
          py::tuple env = EnvStore(false, std::nullopt, timeout_s);
          torch_store = env[0];
          where = env[1].cast<std::string>();
        }
        py::object core =
            Core("shared_attach")(Core("SharedTorchStore")(torch_store, where), name, timeout_s);
        return py::make_tuple(core, Core("shared_attached_dtype")(core, name));
      },
      py::arg("name"), py::arg("store"), py::arg("timeout"),
      "attach()'s work: (the attached tensor, its torch.dtype) of the tensor a group created "
      "under `name` in `store` (None: torchrun's TCPStore, as a client). TypeError for a "
      "name that is not a str, ValueError for an empty one or a timeout that is not positive.");
  m.def(
      "wholememory_group",
      [](const std::string& call, bool initialized, const py::object& group) {
        if (call == "mp_init") {
          if (!initialized) {
            throw std::runtime_error("wholememory: call init_lib() before mp_init()");
          }
          if (!group.is_none()) {
            throw std::runtime_error("wholememory: mp_init() was already called");
          }
        } else if (group.is_none()) {
          throw std::runtime_error(
              StrCat("wholememory: ", call, " needs init_lib() and mp_init() first"));
        }
        return group;
      },
      py::arg("call"), py::arg("initialized"), py::arg("group"),
      "WholeMemory's call order: `group` (the mp_init group, None before) for `call`; "
      "RuntimeError for mp_init before init_lib or twice, and for another call before mp_init.");
  m.def(
      "wholememory_device",
      [](const std::string& call, const std::string& type, const std::string& device) {
        if (type == "cuda") {
          Core("require_cuda_driver")(
              StrCat("wholememory: ", call, device.empty() ? "" : StrCat(" on ", device),
                     " needs device memory, but "),
              "use host memory (is_host=True)");
        } else if (type != "cpu") {
          throw py::value_error(
              StrCat("wholememory: ", call, ": device must be cpu or cuda, not ", device));
        }
      },
      py::arg("call"), py::arg("type"), py::arg("device") = "",
      "WholeMemory's device checks for `call` on a device of torch type `type` (`device`: how "
      "torch writes it): CudaError for CUDA without a driver, ValueError for neither CPU nor "
      "CUDA.");
}
