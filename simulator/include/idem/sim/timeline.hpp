// idem::sim — timelines as pictures: a sequence diagram of what happened to one key, drawn
// as a standalone SVG 1.1 document.
//
// A panel is one run (one scenario, one seed): its lanes are the participants (the clients
// req1..reqN, idem, the bank), simulated time flows down, and each event is a mark on its
// lane at its time with a short label. Several panels sit side by side on one time axis, so
// the same scenario under different policies can be compared row by row. The renderer knows
// nothing of idem: whoever records the events (the demo, a simulator) says what each one is.
#pragma once

#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace idem::sim {

// What an event is, which decides how it is drawn (and its class attribute, "mark <name>",
// see to_string). Bars: a `reserve` or `takeover` opens a solid bar on its lane (the key is
// held) that the lane's next `complete`, `release`, `crash` or `takeover` closes; a `wait`
// opens a dashed bar that the lane's next `wake`, `replay`, `conflict` or `error` closes
// (bars close first in, first out). A `send` draws a thin line to the lane's next `answer`
// (the request is open). A bar or line nothing closes runs to the panel's last instant.
enum class Mark {
  send,        // a client sends a request
  reserve,     // a request reserved the key (it now holds it)
  wait,        // a request found the key held and waits for the holder's outcome
  wake,        // a waiting request was woken
  charge,      // money moved: the provider made a charge
  complete,    // the holder stored its outcome and gave up the key
  replay,      // a stored outcome was answered again; nothing ran
  conflict,    // 409: the key is held by a request in flight
  reuse,       // 422: the same key with a different request
  release,     // the holder released the key without an outcome (the action failed)
  error,       // something failed (a store error, a timeout)
  crash,       // a process died
  takeover,    // a request took over a reservation whose lease had expired
  lease_lost,  // the holder found its lease gone (taken over, or too little left to call out)
  pause,       // a process freezes (a stop-the-world pause): its timers and heartbeats wait
  note,        // anything else
  answer,      // a client receives its answer (a response or an error)
};

// "send", "reserve", ...: the mark's name as the SVG's class attribute carries it.
std::string_view to_string(Mark mark);

struct TimelineEvent {
  long long at_ms = 0;  // simulated time, from the run's start
  std::string lane;     // the participant it happens to
  Mark mark = Mark::note;
  std::string text;      // the short label drawn beside the mark (keep it under ~24 characters)
  std::string detail{};  // a longer description shown as the mark's tooltip; empty: `text`
};

struct TimelinePanel {
  std::string title;
  std::vector<std::string> lanes;     // columns, left to right; lanes of events not listed here
                                      // are appended in order of first appearance
  std::vector<TimelineEvent> events;  // any order; events at one instant on one lane are
                                      // stacked in the order given
  std::string caption{};              // an optional line under the title; default: none
};

// One standalone SVG 1.1 document: `title`, the panels side by side (lanes as columns,
// simulated time flowing down on a shared axis labelled in ms at each instant where
// something happens), each panel's charge count, and a legend of the marks and bars. All
// text is XML-escaped; fonts are generic families; the output depends only on the input
// (same input, same bytes). Distances on the axis are proportional to time except where
// simultaneous events need room to stack, and very long quiet gaps are shortened (drawn
// with a break).
// Thread-safety: a pure function; safe to call from any thread.
std::string timeline_svg(std::string_view title, std::span<const TimelinePanel> panels);

}  // namespace idem::sim
