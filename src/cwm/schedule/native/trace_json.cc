// A trace's MetaSchedule JSON as a compact plain-JSON string, in one call.
//
// TVM's generic object-graph serializer (ffi.ToJSONGraphString) spends ~1 ms per trace; this
// walks the TraceAsJSON value directly. Any other object (RewriteLayout's IndexMap inputs) becomes
// the string MetaSchedule's JSON database stores for it: its JSON object graph with the caller's
// metadata (tvm.ir.save_json's), indented by 2.
// Anything that has no object graph raises, and the Python side falls back to the object graph
// of the whole trace (cwm.schedule.actions.trace_json_text).
#include <tvm/ffi/tvm_ffi.h>
#include <tvm/ffi/reflection/accessor.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>

namespace cwm_ext {
using namespace tvm::ffi;

// Plain JSON of a trace's TraceAsJSON value: arrays, strings, numbers, null, and the
// IntImm/FloatImm immediates as their numbers (booleans as 0/1, as in MetaSchedule's files).
class PlainJSONWriter {
 public:
  explicit PlainJSONWriter(Any metadata) : metadata_(std::move(metadata)) {
    int_imm_ = TypeIndexOf("ir.IntImm");
    float_imm_ = TypeIndexOf("ir.FloatImm");
    if (int_imm_ >= 0) int_value_ = reflection::GetFieldInfo("ir.IntImm", "value");
    if (float_imm_ >= 0) float_value_ = reflection::GetFieldInfo("ir.FloatImm", "value");
  }

  void Write(const AnyView& value) {
    int32_t type = value.type_index();
    switch (type) {
      case TypeIndex::kTVMFFINone:
        out_ += "null";
        return;
      case TypeIndex::kTVMFFIBool:
        out_ += value.cast<bool>() ? '1' : '0';
        return;
      case TypeIndex::kTVMFFIInt:
        out_ += std::to_string(value.cast<int64_t>());
        return;
      case TypeIndex::kTVMFFIFloat:
        WriteFloat(value.cast<double>());
        return;
      case TypeIndex::kTVMFFISmallStr:
      case TypeIndex::kTVMFFIStr:
        WriteString(value.cast<String>());
        return;
      case TypeIndex::kTVMFFIArray: {
        Array<Any> items = value.cast<Array<Any>>();
        out_ += '[';
        for (size_t i = 0; i < items.size(); ++i) {
          if (i) out_ += ',';
          Write(items[i]);
        }
        out_ += ']';
        return;
      }
      default:
        break;
    }
    if (type == int_imm_ || type == float_imm_) {
      ObjectRef obj = value.cast<ObjectRef>();
      Any number = reflection::FieldGetter(type == int_imm_ ? int_value_ : float_value_)(obj);
      if (type == int_imm_) {
        out_ += std::to_string(number.cast<int64_t>());
      } else {
        WriteFloat(number.cast<double>());
      }
      return;
    }
    if (type >= TypeIndex::kTVMFFIDynObjectBegin) {  // a registered node type, not a container
      static Function to_graph = Function::GetGlobalRequired("ffi.ToJSONGraph");
      static Function stringify = Function::GetGlobalRequired("ffi.json.Stringify");
      WriteString(stringify(to_graph(value, metadata_), 2).cast<String>());
      return;
    }
    TVM_FFI_THROW(TypeError) << "no plain JSON value for type index " << type;
  }

  String Result() { return String(out_); }

 private:
  static int32_t TypeIndexOf(const char* key) {
    int32_t index = -1;
    TVMFFIByteArray bytes{key, std::strlen(key)};
    if (TVMFFITypeKeyToIndex(&bytes, &index) != 0) return -1;
    return index;
  }

  void WriteFloat(double x) {
    if (!std::isfinite(x)) TVM_FFI_THROW(ValueError) << "non-finite float in trace";
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%.17g", x);
    out_ += buf;
    // Keep it a float for json.loads: "2" would read back as an int.
    if (std::strpbrk(buf, ".eEn") == nullptr) out_ += ".0";
  }

  void WriteString(const String& s) {
    out_ += '"';
    for (size_t i = 0; i < s.size(); ++i) {
      unsigned char c = static_cast<unsigned char>(s.data()[i]);
      if (c == '"' || c == '\\') {
        out_ += '\\';
        out_ += static_cast<char>(c);
      } else if (c < 0x20) {
        char buf[8];
        std::snprintf(buf, sizeof(buf), "\\u%04x", c);
        out_ += buf;
      } else {
        out_ += static_cast<char>(c);
      }
    }
    out_ += '"';
  }

  std::string out_;
  Any metadata_;
  int32_t int_imm_;
  int32_t float_imm_;
  const TVMFFIFieldInfo* int_value_ = nullptr;
  const TVMFFIFieldInfo* float_value_ = nullptr;
};

}  // namespace cwm_ext

tvm::ffi::String trace_plain_json(tvm::ffi::ObjectRef trace, bool remove_postproc, tvm::ffi::Any metadata) {
  // Thread-safe static init; the writer itself is per call.
  static tvm::ffi::Function as_json = tvm::ffi::Function::GetGlobalRequired("s_tir.schedule.TraceAsJSON");
  tvm::ffi::Any json = as_json(trace, remove_postproc);
  cwm_ext::PlainJSONWriter writer(metadata);
  writer.Write(json);
  return writer.Result();
}
