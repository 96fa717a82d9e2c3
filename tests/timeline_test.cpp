// idem::sim::timeline_svg and `idem-demo table --svg`: the figures are well-formed SVG 1.1
// (parsed by a real XML parser, expat), their text survives escaping, and the in-flight
// figure shows the charges the table counts.
#include <doctest/doctest.h>
#include <expat.h>
#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>

#include <algorithm>
#include <fstream>
#include <functional>
#include <memory>
#include <set>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "idem/sim/timeline.hpp"
#include "scenarios.hpp"
#include "test_support.hpp"

extern char** environ;

namespace {

using idem::sim::Mark;
using idem::sim::TimelineEvent;
using idem::sim::TimelinePanel;

// A parsed element: name, attributes, character data and children.
struct Element {
  std::string name;
  std::vector<std::pair<std::string, std::string>> attributes;
  std::string text;
  std::vector<std::unique_ptr<Element>> children;

  std::string attr(const std::string& key) const {
    for (const auto& [k, v] : attributes)
      if (k == key) return v;
    return {};
  }
  bool has_class(const std::string& c) const {
    std::istringstream in(attr("class"));
    std::string token;
    while (in >> token)
      if (token == c) return true;
    return false;
  }
  // Every element below this one (depth first, in document order), itself included.
  void walk(const std::function<void(const Element&)>& f) const {
    f(*this);
    for (const auto& c : children) c->walk(f);
  }
};

struct Parser {
  std::unique_ptr<Element> root;
  std::vector<Element*> open;
};

// Parses `xml` with expat; fails the test (with expat's message and line) if it is not
// well-formed.
std::unique_ptr<Element> parse_xml(const std::string& xml) {
  Parser p;
  std::unique_ptr<XML_ParserStruct, decltype(&XML_ParserFree)> parser(XML_ParserCreate("UTF-8"),
                                                                      &XML_ParserFree);
  REQUIRE(parser != nullptr);
  XML_SetUserData(parser.get(), &p);
  XML_SetElementHandler(
      parser.get(),
      [](void* data, const XML_Char* name, const XML_Char** attrs) {
        auto& self = *static_cast<Parser*>(data);
        auto e = std::make_unique<Element>();
        e->name = name;
        for (std::size_t i = 0; attrs[i] != nullptr; i += 2)
          e->attributes.emplace_back(attrs[i], attrs[i + 1]);
        Element* raw = e.get();
        if (self.open.empty()) {
          self.root = std::move(e);
        } else {
          self.open.back()->children.push_back(std::move(e));
        }
        self.open.push_back(raw);
      },
      [](void* data, const XML_Char*) { static_cast<Parser*>(data)->open.pop_back(); });
  XML_SetCharacterDataHandler(parser.get(), [](void* data, const XML_Char* s, int len) {
    auto& self = *static_cast<Parser*>(data);
    if (!self.open.empty()) self.open.back()->text.append(s, static_cast<std::size_t>(len));
  });
  const XML_Status status =
      XML_Parse(parser.get(), xml.data(), static_cast<int>(xml.size()), XML_TRUE);
  INFO("expat: ", std::string(XML_ErrorString(XML_GetErrorCode(parser.get()))), " at line ",
       XML_GetCurrentLineNumber(parser.get()));
  REQUIRE(status == XML_STATUS_OK);
  REQUIRE(p.root != nullptr);
  return std::move(p.root);
}

// The checks every figure passes: an SVG 1.1 root with its size, only SVG 1.1 elements
// from the small set the renderer uses.
void check_svg_root(const Element& root) {
  CHECK(root.name == "svg");
  CHECK(root.attr("xmlns") == "http://www.w3.org/2000/svg");
  CHECK(root.attr("version") == "1.1");
  CHECK_FALSE(root.attr("width").empty());
  CHECK_FALSE(root.attr("height").empty());
  CHECK(root.attr("viewBox") == "0 0 " + root.attr("width") + " " + root.attr("height"));
  const std::set<std::string> allowed = {"svg",  "g",      "rect",  "line", "text",
                                         "path", "circle", "title", "defs", "marker"};
  root.walk([&](const Element& e) {
    CAPTURE(e.name);
    CHECK(allowed.count(e.name) == 1);
  });
}

// The panels (g class="panel") in document order.
std::vector<const Element*> panels_of(const Element& root) {
  std::vector<const Element*> out;
  root.walk([&](const Element& e) {
    if (e.name == "g" && e.has_class("panel")) out.push_back(&e);
  });
  return out;
}

std::size_t count_marks(const Element& panel, const std::string& mark) {
  std::size_t n = 0;
  panel.walk([&](const Element& e) {
    if (e.name == "g" && e.has_class("mark") && e.has_class(mark)) ++n;
  });
  return n;
}

std::size_t count_class(const Element& panel, const std::string& c) {
  std::size_t n = 0;
  panel.walk([&](const Element& e) {
    if (e.has_class(c)) ++n;
  });
  return n;
}

std::size_t count_bars(const Element& panel, const std::string& kind) {
  std::size_t n = 0;
  panel.walk([&](const Element& e) {
    if (e.has_class("bar") && e.has_class(kind)) ++n;
  });
  return n;
}

std::string panel_title(const Element& panel) {
  std::string title;
  panel.walk([&](const Element& e) {
    if (title.empty() && e.has_class("panel-title")) title = e.text;
  });
  return title;
}

std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

const std::string kNasty = R"(a<b & "c" 'd'> ]]>)";

std::vector<TimelinePanel> hand_made() {
  TimelinePanel a;
  a.title = "run: " + kNasty;
  a.lanes = {"req1", "req2", "idem"};  // "bank" is appended on first appearance
  a.events = {
      TimelineEvent{0, "req1", Mark::send, "sends"},
      TimelineEvent{0, "idem", Mark::reserve, "reserved"},
      TimelineEvent{50, "req2", Mark::send, "sends"},
      TimelineEvent{50, "idem", Mark::wait, "waits"},
      TimelineEvent{300, "bank", Mark::charge, "charged ch_1"},
      TimelineEvent{300, "bank", Mark::charge, "charged ch_2", kNasty},
      TimelineEvent{300, "idem", Mark::complete, "completed"},
      TimelineEvent{300, "idem", Mark::replay, kNasty},
      TimelineEvent{300, "req1", Mark::answer, "<- ch_1"},
  };
  TimelinePanel b;
  b.title = "wait";
  b.events = {TimelineEvent{0, "req1", Mark::send, "sends"},
              TimelineEvent{300, "bank", Mark::charge, "charged ch_1"}};
  return {a, b};
}

}  // namespace

TEST_CASE("timeline: a figure is well-formed SVG 1.1 that expat parses, identical every time") {
  const std::vector<TimelinePanel> panels = hand_made();
  const std::string svg = idem::sim::timeline_svg("title " + kNasty, panels);
  CHECK(svg.starts_with("<?xml version=\"1.0\""));
  const auto root = parse_xml(svg);
  check_svg_root(*root);
  CHECK(idem::sim::timeline_svg("title " + kNasty, panels) == svg);
}

TEST_CASE("timeline: each panel marks its charges, one mark per charge") {
  const auto root = parse_xml(idem::sim::timeline_svg("t", hand_made()));
  const auto panels = panels_of(*root);
  REQUIRE(panels.size() == 2);
  CHECK(count_marks(*panels[0], "charge") == 2);
  CHECK(count_marks(*panels[1], "charge") == 1);
  CHECK(count_marks(*panels[0], "send") == 2);
  std::size_t headers = 0;  // "bank" was not listed, and is appended as a lane
  panels[0]->walk([&](const Element& e) {
    if (e.has_class("lane") && e.text == "bank") ++headers;
  });
  CHECK(headers == 1);
}

TEST_CASE("timeline: XML special characters in titles, labels and details survive the round trip") {
  const auto root = parse_xml(idem::sim::timeline_svg("title " + kNasty, hand_made()));
  std::size_t labels = 0, titles = 0, tooltips = 0;
  root->walk([&](const Element& e) {
    if (e.has_class("label") && e.text == kNasty) ++labels;
    if (e.has_class("panel-title") && e.text == "run: " + kNasty) ++titles;
    if (e.name == "title" && e.text == "t=300 ms bank: " + kNasty) ++tooltips;
  });
  CHECK(labels == 1);
  CHECK(titles == 1);
  CHECK(tooltips == 1);
  CHECK(root->children.front()->name == "title");
  CHECK(root->children.front()->text == "title " + kNasty);
}

TEST_CASE(
    "timeline: a reservation is a solid bar and a wait a dashed one, each closed by its end") {
  const auto root = parse_xml(idem::sim::timeline_svg("t", hand_made()));
  const auto panels = panels_of(*root);
  REQUIRE(panels.size() == 2);
  std::vector<const Element*> holds, waits, marks;
  panels[0]->walk([&](const Element& e) {
    if (e.has_class("bar") && e.has_class("hold")) holds.push_back(&e);
    if (e.has_class("bar") && e.has_class("wait")) waits.push_back(&e);
    if (e.has_class("mark")) marks.push_back(&e);
  });
  REQUIRE(holds.size() == 1);
  REQUIRE(waits.size() == 1);
  CHECK(count_class(*panels[1], "bar") == 0);
  // The reservation ends where "completed" is drawn, the wait where the replay is.
  auto y_of_mark = [&](const std::string& mark) {
    for (const Element* m : marks)
      if (m->has_class(mark)) {
        const std::string t = m->attr("transform");  // translate(x,y)
        return std::stod(t.substr(t.find(',') + 1));
      }
    FAIL("no mark ", mark);
    return 0.0;
  };
  const double hold_end = std::stod(holds[0]->attr("y")) + std::stod(holds[0]->attr("height"));
  const double wait_end = std::stod(waits[0]->attr("y")) + std::stod(waits[0]->attr("height"));
  CHECK(hold_end == doctest::Approx(y_of_mark("complete")).epsilon(0.001));
  CHECK(wait_end == doctest::Approx(y_of_mark("replay")).epsilon(0.001));
  CHECK(std::stod(holds[0]->attr("y")) == doctest::Approx(y_of_mark("reserve")).epsilon(0.001));
}

TEST_CASE("timeline: events at one instant on one lane are stacked, never drawn on one spot") {
  const auto root = parse_xml(idem::sim::timeline_svg("t", hand_made()));
  const auto panels = panels_of(*root);
  REQUIRE(panels.size() == 2);
  std::set<std::string> spots;
  std::size_t marks = 0;
  panels[0]->walk([&](const Element& e) {
    if (!e.has_class("mark")) return;
    ++marks;
    spots.insert(e.attr("transform"));
  });
  CHECK(marks == 9);
  CHECK(spots.size() == marks);  // two charges at 300 on bank, complete + replay on idem
}

TEST_CASE(
    "demo: table --svg figures all parse, and in-flight shows 2 charges for run, 1 for wait and "
    "raise") {
  idem::test::TempDir dir;
  const std::filesystem::path out = std::filesystem::path(dir.file("figures")) / "nested";
  const auto written = idem::demo::write_table_figures(out);
  REQUIRE(written.size() == 11);
  for (const auto& path : written) {
    CAPTURE(path.string());
    const auto root = parse_xml(read_file(path));
    check_svg_root(*root);
    CHECK_FALSE(panels_of(*root).empty());
  }
  const auto in_flight = parse_xml(read_file(out / "in-flight.svg"));
  const auto panels = panels_of(*in_flight);
  REQUIRE(panels.size() == 3);
  CHECK(panel_title(*panels[0]).starts_with("in_flight='run'"));
  CHECK(panel_title(*panels[1]).starts_with("in_flight='wait'"));
  CHECK(panel_title(*panels[2]).starts_with("in_flight='raise'"));
  CHECK(count_marks(*panels[0], "charge") == 2);
  CHECK(count_marks(*panels[1], "charge") == 1);
  CHECK(count_marks(*panels[2], "charge") == 1);
  // The key is held under wait and raise (the reservation), never under run (a cache).
  CHECK(count_bars(*panels[0], "hold") == 0);
  CHECK(count_bars(*panels[1], "hold") == 1);
  CHECK(count_bars(*panels[2], "hold") == 1);
  CHECK(count_bars(*panels[1], "wait") == 1);       // the duplicate waits
  CHECK(count_marks(*panels[2], "conflict") == 1);  // the duplicate gets 409
  // The same figures on every run.
  CHECK(idem::demo::table_figures().front().svg == read_file(out / "in-flight.svg"));

  // The paused owner: the pause, then the refused call and one charge; with the check off, the
  // takeover during the late call and two charges.
  const auto paused = parse_xml(read_file(out / "paused-owner.svg"));
  const auto rows = panels_of(*paused);
  REQUIRE(rows.size() == 2);
  CHECK(panel_title(*rows[0]).starts_with("lease checked"));
  CHECK(count_marks(*rows[0], "pause") == 1);
  CHECK(count_marks(*rows[0], "lease_lost") == 1);
  CHECK(count_marks(*rows[0], "takeover") == 0);
  CHECK(count_marks(*rows[0], "charge") == 1);
  CHECK(panel_title(*rows[1]).starts_with("token only"));
  CHECK(count_marks(*rows[1], "pause") == 1);
  CHECK(count_marks(*rows[1], "takeover") == 1);
  CHECK(count_marks(*rows[1], "charge") == 2);
}

TEST_CASE("demo: --timeline text lines are unchanged by the marks the SVG needs") {
  const std::string text = idem::demo::render_table(false, true);
  CHECK(text.find("    t=  50 ms  req2   sends the request\n"
                  "    t=  50 ms  idem   waiting key ") != std::string::npos);
  CHECK(text.find("    t= 350 ms  bank   provider: charged ch_2 for A-10023\n") !=
        std::string::npos);
  CHECK(text.find("    t=  50 ms  req2   <- IdempotencyInProgressError\n") != std::string::npos);
  CHECK(text.find("    t=   0 ms  shop   the process dies after debited\n") != std::string::npos);
}

TEST_CASE("demo: idem-demo table --svg DIR writes the figures and prints their paths") {
  idem::test::TempDir dir;
  const std::string out = dir.file("svg"), log = dir.file("stdout");
  std::vector<std::string> args = {IDEM_DEMO, "table", "--svg", out};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  pid_t pid = 0;
  REQUIRE(posix_spawn(&pid, IDEM_DEMO, &actions, nullptr, argv.data(), environ) == 0);
  posix_spawn_file_actions_destroy(&actions);
  int status = 0;
  REQUIRE(waitpid(pid, &status, 0) == pid);
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  const std::string printed = read_file(log);
  CHECK(printed.find("wrote " + out + "/in-flight.svg\n") != std::string::npos);
  CHECK(parse_xml(read_file(std::filesystem::path(out) / "in-flight.svg"))->name == "svg");
}

TEST_CASE("timeline: a holder that finds its lease lost holds the key no more from that mark on") {
  TimelinePanel p;
  p.title = "zombie";
  p.lanes = {"idem@p0", "idem@p1"};
  p.events = {
      TimelineEvent{0, "idem@p0", Mark::reserve, "reserved"},
      TimelineEvent{1000, "idem@p1", Mark::takeover, "took over"},
      TimelineEvent{1500, "idem@p0", Mark::lease_lost, "lease lost"},
      TimelineEvent{2000, "idem@p1", Mark::complete, "completed"},
  };
  const auto root = parse_xml(idem::sim::timeline_svg("t", std::span<const TimelinePanel>(&p, 1)));
  const auto panels = panels_of(*root);
  REQUIRE(panels.size() == 1);
  std::vector<const Element*> holds;
  double lost_y = -1;
  panels[0]->walk([&](const Element& e) {
    if (e.has_class("bar") && e.has_class("hold")) holds.push_back(&e);
    if (e.has_class("mark") && e.has_class("lease_lost")) {
      const std::string t = e.attr("transform");  // translate(x,y)
      lost_y = std::stod(t.substr(t.find(',') + 1));
    }
  });
  REQUIRE(holds.size() == 2);  // p0's reservation, p1's takeover
  REQUIRE(lost_y > 0);
  // p0's bar is the one that starts first; it ends where its lease_lost is drawn.
  const Element* first =
      std::stod(holds[0]->attr("y")) < std::stod(holds[1]->attr("y")) ? holds[0] : holds[1];
  const double end = std::stod(first->attr("y")) + std::stod(first->attr("height"));
  CHECK(end == doctest::Approx(lost_y).epsilon(0.001));
}
