// The mpi backend's CPython fast path (mpi_fast.cpp): its hot ops as METH_FASTCALL
// functions over the C++ communicators of mpi_comm.cpp, whose entry points are these.
#pragma once

#include <pybind11/pybind11.h>

namespace mcrdl {

namespace py = pybind11;

class MpiComm;  // mpi_comm.cpp

// MpiComm's hot ops, as the Python methods take them (mpi_comm.cpp).
py::object mpi_all_reduce(MpiComm& c, py::handle tensor, int rop, bool async_op);
py::object mpi_bcast(MpiComm& c, py::handle tensor, py::handle src, bool async_op);
py::object mpi_all_gather(MpiComm& c, py::handle output, py::handle input, bool async_op);
py::object mpi_reduce_scatter(MpiComm& c, py::handle output, py::handle input, int rop,
                              bool async_op);
py::object mpi_barrier(MpiComm& c, bool async_op);
// The C++ communicator of a Python MpiComm object (raises a cast error otherwise).
MpiComm* mpi_comm_of(py::handle comm);

// Defines _C.mpi_fast_ops (mpi_fast.cpp).
void bind_mpi_fast(py::module_& m);

}  // namespace mcrdl
