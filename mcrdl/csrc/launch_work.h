// Hand a posted op to whoever drives it: the backend's lane (async: the Work goes back
// to Python) or the calling thread (blocking: wait with the GIL released; a timeout
// fails the lane, which keeps the op's buffers alive). Shared by MpiComm and PcclComm.
#pragma once

#include <c10/core/InferenceMode.h>
#include <torch/csrc/utils/pybind.h>

#include "lane.h"

namespace mcrdl {

inline pybind11::object launch_work(const std::shared_ptr<Lane>& lane,
                                    const std::shared_ptr<Work>& w, bool async_op) {
  if (async_op) {
    // The op's finish step (a cast back, AVG's division, copies into list outputs) runs
    // on whichever thread sees it complete, often the lane's: under the caller's
    // InferenceMode, or writing into an inference tensor raises there.
    if (w->finish && c10::InferenceMode::is_enabled())
      w->finish = [f = std::move(w->finish)] {
        c10::InferenceMode guard;
        f();
      };
    lane->track(w);
    return pybind11::cast(w);
  }
  {
    pybind11::gil_scoped_release nogil;
    try {
      w->wait();
    } catch (const Error& e) {
      if (e.kind() == ErrorKind::Timeout) lane->fail(e.what(), w);  // keeps buffers alive
      throw;
    }
  }
  return pybind11::none();
}

}  // namespace mcrdl
