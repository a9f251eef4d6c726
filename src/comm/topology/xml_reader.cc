#include "comm/topology/xml_reader.h"

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace strata {
namespace topology_internal {

const std::string* XmlNode::Attr(absl::string_view key) const {
  for (const auto& [k, v] : attrs) {
    if (k == key) return &v;
  }
  return nullptr;
}

namespace {

class Parser {
 public:
  explicit Parser(absl::string_view text) : s_(text) {}

  absl::StatusOr<XmlNode> Document() {
    XmlNode doc;
    while (true) {
      absl::Status st = SkipMisc();
      if (!st.ok()) return st;
      if (pos_ >= s_.size()) break;
      if (s_[pos_] != '<') return Error("expected '<' outside of any element");
      if (Peek("</")) return Error("closing tag without an opening tag");
      XmlNode child;
      st = Element(1, &child);
      if (!st.ok()) return st;
      doc.children.push_back(std::move(child));
    }
    return doc;
  }

 private:
  absl::Status Error(absl::string_view what) const {
    return absl::InvalidArgumentError(absl::StrCat("XML line ", line_, ": ", what));
  }
  bool Peek(absl::string_view p) const { return s_.substr(pos_, p.size()) == p; }
  void Advance(size_t n) {
    for (size_t i = 0; i < n && pos_ < s_.size(); ++i, ++pos_) {
      if (s_[pos_] == '\n') ++line_;
    }
  }
  void SkipSpace() {
    while (pos_ < s_.size() && absl::ascii_isspace(static_cast<unsigned char>(s_[pos_])))
      Advance(1);
  }
  // Skips text, comments, <?...?> and <!...> until the next element tag.
  absl::Status SkipMisc() {
    while (pos_ < s_.size()) {
      if (s_[pos_] != '<') {
        Advance(1);
        continue;
      }
      if (Peek("<!--")) {
        size_t end = s_.find("-->", pos_ + 4);
        if (end == absl::string_view::npos) return Error("unterminated comment");
        Advance(end + 3 - pos_);
      } else if (Peek("<?") || Peek("<!")) {
        size_t end = s_.find('>', pos_);
        if (end == absl::string_view::npos) return Error("unterminated declaration");
        Advance(end + 1 - pos_);
      } else {
        return absl::OkStatus();
      }
    }
    return absl::OkStatus();
  }
  static bool NameChar(char c) {
    return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-' || c == '.' ||
           c == ':';
  }
  bool Name(std::string* out) {
    size_t start = pos_;
    while (pos_ < s_.size() && NameChar(s_[pos_])) ++pos_;
    *out = std::string(s_.substr(start, pos_ - start));
    return !out->empty();
  }
  static std::string Decode(absl::string_view v) {
    std::string out;
    for (size_t i = 0; i < v.size(); ++i) {
      if (v[i] == '&') {
        static const std::pair<const char*, char> kEntities[] = {
            {"&lt;", '<'}, {"&gt;", '>'}, {"&amp;", '&'}, {"&quot;", '"'}, {"&apos;", '\''}};
        bool done = false;
        for (const auto& [ent, ch] : kEntities) {
          absl::string_view e(ent);
          if (v.substr(i, e.size()) == e) {
            out.push_back(ch);
            i += e.size() - 1;
            done = true;
            break;
          }
        }
        if (done) continue;
      }
      out.push_back(v[i]);
    }
    return out;
  }

  absl::Status Element(int depth, XmlNode* node) {
    if (depth > kMaxXmlDepth)
      return Error(absl::StrCat("elements nested deeper than ", kMaxXmlDepth));
    if (++elements_ > kMaxXmlElements)
      return Error(absl::StrCat("more than ", kMaxXmlElements, " elements"));
    node->line = line_;
    Advance(1);  // '<'
    if (!Name(&node->name)) return Error("expected an element name after '<'");
    while (true) {
      SkipSpace();
      if (pos_ >= s_.size()) return Error(absl::StrCat("unterminated start tag <", node->name));
      if (Peek("/>")) {
        Advance(2);
        return absl::OkStatus();
      }
      if (s_[pos_] == '>') {
        Advance(1);
        break;
      }
      std::string key;
      if (!Name(&key)) {
        return Error(absl::StrCat("unexpected '", s_.substr(pos_, 1), "' in <", node->name, ">"));
      }
      SkipSpace();
      if (pos_ >= s_.size() || s_[pos_] != '=') {
        return Error(absl::StrCat("attribute ", key, " of <", node->name, "> has no '='"));
      }
      Advance(1);
      SkipSpace();
      if (pos_ >= s_.size() || (s_[pos_] != '"' && s_[pos_] != '\'')) {
        return Error(absl::StrCat("attribute ", key, " of <", node->name, "> is not quoted"));
      }
      char quote = s_[pos_];
      size_t end = s_.find(quote, pos_ + 1);
      if (end == absl::string_view::npos) {
        return Error(absl::StrCat("unterminated value of attribute ", key));
      }
      if (node->attrs.size() >= static_cast<size_t>(kMaxXmlAttributes)) {
        return Error(
            absl::StrCat("<", node->name, "> has more than ", kMaxXmlAttributes, " attributes"));
      }
      node->attrs.emplace_back(std::move(key), Decode(s_.substr(pos_ + 1, end - pos_ - 1)));
      Advance(end + 1 - pos_);
    }
    // Content: children until the matching end tag.
    while (true) {
      absl::Status st = SkipMisc();
      if (!st.ok()) return st;
      if (pos_ >= s_.size()) return Error(absl::StrCat("<", node->name, "> is never closed"));
      if (Peek("</")) {
        Advance(2);
        std::string name;
        Name(&name);
        SkipSpace();
        if (name != node->name || pos_ >= s_.size() || s_[pos_] != '>') {
          return Error(absl::StrCat("expected </", node->name, ">, found </", name));
        }
        Advance(1);
        return absl::OkStatus();
      }
      XmlNode child;
      st = Element(depth + 1, &child);
      if (!st.ok()) return st;
      node->children.push_back(std::move(child));
    }
  }

  absl::string_view s_;
  size_t pos_ = 0;
  int line_ = 1;
  int elements_ = 0;
};

}  // namespace

absl::StatusOr<XmlNode> ParseXml(absl::string_view text) { return Parser(text).Document(); }

}  // namespace topology_internal
}  // namespace strata
