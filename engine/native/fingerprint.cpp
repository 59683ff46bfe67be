// kernelmux's native call fingerprint (engine/fingerprint.py): the bytes of everything a spec's
// validation reads of a call, built without the interpreter's per-attribute cost. Per tensor its
// dtype, device, shape, strides and address modulo the largest alignment a Layout holds; per plain
// argument (None, bool, int, float, str, torch.dtype) its type and value; then the keywords' names.
// None where an argument is anything else: that call is validated every time.
#include <Python.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <cstring>
#include <string>

namespace {

PyObject* tensor_types = nullptr;  // the tensor classes read directly (torch.Tensor, nn.Parameter)
uint64_t alignment_mask = 0;

template <typename T>
void put(std::string& out, T value) {
  out.append(reinterpret_cast<const char*>(&value), sizeof(T));
}

bool put_text(std::string& out, PyObject* text) {
  Py_ssize_t size = 0;
  const char* data = PyUnicode_AsUTF8AndSize(text, &size);
  if (data == nullptr) {
    PyErr_Clear();
    return false;
  }
  put<int64_t>(out, size);
  out.append(data, size);
  return true;
}

bool is_read_type(PyObject* value) {
  PyObject* type = reinterpret_cast<PyObject*>(Py_TYPE(value));
  Py_ssize_t count = PyTuple_GET_SIZE(tensor_types);
  for (Py_ssize_t i = 0; i < count; ++i) {
    if (PyTuple_GET_ITEM(tensor_types, i) == type) return true;
  }
  return false;
}

// False where the argument cannot be fingerprinted (a subclass, a symbolic shape, no storage...).
bool put_value(std::string& out, PyObject* value) {
  if (value == Py_None) {
    out.push_back('N');
  } else if (PyBool_Check(value)) {
    out.push_back('b');
    out.push_back(value == Py_True ? 1 : 0);
  } else if (PyLong_CheckExact(value)) {
    int overflow = 0;
    long long number = PyLong_AsLongLongAndOverflow(value, &overflow);
    if (overflow != 0 || (number == -1 && PyErr_Occurred())) {
      PyErr_Clear();
      return false;
    }
    out.push_back('i');
    put<int64_t>(out, number);
  } else if (PyFloat_CheckExact(value)) {
    out.push_back('f');
    put<double>(out, PyFloat_AS_DOUBLE(value));
  } else if (PyUnicode_CheckExact(value)) {
    out.push_back('s');
    return put_text(out, value);
  } else if (THPDtype_Check(value)) {
    out.push_back('d');
    put<int8_t>(out, static_cast<int8_t>(reinterpret_cast<THPDtype*>(value)->scalar_type));
  } else if (is_read_type(value)) {
    const at::Tensor& tensor = THPVariable_Unpack(value);
    if (!tensor.defined() || tensor.layout() != at::kStrided ||
        tensor.unsafeGetTensorImpl()->has_symbolic_sizes_strides()) {
      return false;
    }
    out.push_back('T');
    put<int8_t>(out, static_cast<int8_t>(tensor.scalar_type()));
    put<int8_t>(out, static_cast<int8_t>(tensor.device().type()));
    put<int8_t>(out, static_cast<int8_t>(tensor.device().index()));
    const auto sizes = tensor.sizes();
    const auto strides = tensor.strides();
    put<int64_t>(out, static_cast<int64_t>(sizes.size()));
    out.append(reinterpret_cast<const char*>(sizes.data()), sizeof(int64_t) * sizes.size());
    out.append(reinterpret_cast<const char*>(strides.data()), sizeof(int64_t) * strides.size());
    put<uint64_t>(out, reinterpret_cast<uintptr_t>(tensor.data_ptr()) & alignment_mask);
  } else {
    return false;
  }
  return true;
}

PyObject* fingerprint(PyObject*, PyObject* const* argv, Py_ssize_t argc) {
  if (argc != 2 || !PyTuple_Check(argv[0]) || !PyDict_Check(argv[1]) || tensor_types == nullptr) {
    PyErr_SetString(PyExc_TypeError, "fingerprint(args: tuple, kwargs: dict), after configure()");
    return nullptr;
  }
  PyObject* args = argv[0];
  PyObject* kwargs = argv[1];
  std::string out;
  out.reserve(512);
  try {
    for (Py_ssize_t i = 0, n = PyTuple_GET_SIZE(args); i < n; ++i) {
      if (!put_value(out, PyTuple_GET_ITEM(args, i))) Py_RETURN_NONE;
    }
    if (PyDict_GET_SIZE(kwargs) > 0) {
      PyObject *name, *value;
      Py_ssize_t position = 0;
      while (PyDict_Next(kwargs, &position, &name, &value)) {
        if (!put_value(out, value)) Py_RETURN_NONE;
      }
      position = 0;
      while (PyDict_Next(kwargs, &position, &name, &value)) {  // the names, in order, as the Python one
        out.push_back('k');
        if (!PyUnicode_Check(name) || !put_text(out, name)) Py_RETURN_NONE;
      }
    }
  } catch (...) {  // a tensor whose metadata cannot be read here: validated every time instead
    PyErr_Clear();
    Py_RETURN_NONE;
  }
  return PyBytes_FromStringAndSize(out.data(), static_cast<Py_ssize_t>(out.size()));
}

PyObject* configure(PyObject*, PyObject* const* argv, Py_ssize_t argc) {
  if (argc != 2 || !PyTuple_Check(argv[0]) || !PyLong_Check(argv[1])) {
    PyErr_SetString(PyExc_TypeError, "configure(tensor_types: tuple, alignment_mask: int)");
    return nullptr;
  }
  Py_XSETREF(tensor_types, Py_NewRef(argv[0]));
  alignment_mask = PyLong_AsUnsignedLongLong(argv[1]);
  if (PyErr_Occurred()) return nullptr;
  Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"fingerprint", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(fingerprint)), METH_FASTCALL,
     "fingerprint(args, kwargs) -> bytes, or None where an argument cannot be fingerprinted"},
    {"configure", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(configure)), METH_FASTCALL,
     "configure(tensor_types, alignment_mask): the tensor classes read directly, the address bits kept"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, nullptr, "kernelmux's native call fingerprint", -1, methods};

}  // namespace

#define KERNELMUX_CONCAT_(a, b) a##b
#define KERNELMUX_CONCAT(a, b) KERNELMUX_CONCAT_(a, b)
#define KERNELMUX_STRING_(a) #a
#define KERNELMUX_STRING(a) KERNELMUX_STRING_(a)

PyMODINIT_FUNC KERNELMUX_CONCAT(PyInit_, TORCH_EXTENSION_NAME)(void) {
  module.m_name = KERNELMUX_STRING(TORCH_EXTENSION_NAME);
  return PyModule_Create(&module);
}
