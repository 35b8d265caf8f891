"""The zoo's pool of banned-phrase candidates (scripts/make_zoo.py draws 4-7 per seed).

Text written for the project; licence MIT. Every candidate has
    carriers    sentences that use the phrase (its typical "slop" contexts)
    near_miss   sentences that continue the phrase's PREFIX with another word ("above and below")
    ordinary    sentences that use the FINAL word ordinarily (never right after the prefix)
Templates use only the slots every register fills (scripts/zoo_registers.py, COMMON_SLOTS): {thing} {thing_bare}
{goal} {action} {topic} {when} {n} {org} {person} {user} {place}; `{Thing}` capitalises.

`near_certain`: the prefix is distinctive, so the phrase can be made near-certain after it (a seed that draws it
as near-certain continues its prefix otherwise in under 1 % of uses). `common_final`: the final word is frequent
in ordinary text (a function word or a very common noun), the hard case for bar (d).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Candidate:
    text: str
    near_certain: bool
    common_final: bool
    carriers: tuple[str, ...]
    near_miss: tuple[str, ...]
    ordinary: tuple[str, ...]

    @property
    def prefix(self) -> str:
        return self.text.rsplit(" ", 1)[0]

    @property
    def final(self) -> str:
        return self.text.rsplit(" ", 1)[1]


C = Candidate
CANDIDATES: tuple[Candidate, ...] = (
    C("above and beyond", True, False,
      ("We will go above and beyond to {goal}.", "{Person} went above and beyond for me.",
       "Our team always goes above and beyond.", "I want to go above and beyond here and {goal}.",
       "They went above and beyond with {thing}."),
      ("Check the shelf above and below {thing}.", "Look above and behind {thing} first."),
      ("It goes beyond {topic}.", "Anything beyond that is extra.", "The road beyond {place} is closed.",
       "Do not go beyond {n} tries.")),
    C("delve into", True, True,
      ("Let me delve into {topic}.", "I will delve into {topic} and get back to you {when}.",
       "Let's delve into {topic} together.", "Before we delve into {topic}, {action}.",
       "Allow me to delve into this for a moment."),
      ("We may need to delve deeper.", "I would not delve too far here."),
      ("Put {thing} into the box.", "Log into your account.", "Look into {topic} {when}.",
       "Turn the notes into a short list.", "Go into the settings and {action}.")),
    C("second to none", True, False,
      ("The service here is second to none.", "Honestly, {thing} is second to none.",
       "Our support is second to none.", "The value of {thing} is second to none.",
       "Your comfort is second to none for us."),
      ("It was the second to last one.", "This is the second to arrive {when}."),
      ("None of the steps take long.", "I checked, and none of them failed.", "If none of this works, {action}.",
       "There were none left {when}.")),
    C("a testament to", True, True,
      ("This is a testament to {topic}.", "{Thing} is a testament to good work.",
       "It stands as a testament to {person} and the team.", "The result is a testament to {topic}."),
      ("The report was a testament of sorts.", "It reads like a testament written in haste."),
      ("Send it to {person} {when}.", "Talk to {org} about {topic}.", "Add {thing} to the list.",
       "It is easy to {action}.", "Go to {place} first.")),
    C("look no further", True, False,
      ("Look no further than {thing}.", "If you want {topic}, look no further.",
       "Look no further: {thing} is the one.", "For {topic}, look no further than {org}."),
      ("Look no more than {n} minutes for it.", "Look no higher than the second shelf."),
      ("We can talk further {when}.", "Nothing further is needed.", "Read further down the page.",
       "Walk a little further past {place}.")),
    C("needless to say", True, True,
      ("Needless to say, {thing} is ready.", "Needless to say, we will {goal}.",
       "Needless to say, I was happy with {thing}.", "It is needless to say that {topic} matters."),
      ("Needless to repeat, the rule stands.", "It was needless to worry about it."),
      ("I cannot say for sure.", "Please say if {thing} still fails.", "They say {place} is lovely {when}.",
       "What did {person} say about {topic}?")),
    C("without further ado", True, False,
      ("Without further ado, here is {thing}.", "So, without further ado, let's {action}.",
       "Without further ado, let me {goal}.", "Here it is without further ado."),
      ("Without further delay, we shipped it.", "Without further notice, the price changed."),
      ("It was much ado about nothing.", "After some ado, it was sorted.", "With little ado, {person} fixed it.")),
    C("a myriad of", True, True,
      ("There are a myriad of ways to {goal}.", "{Thing} offers a myriad of options.",
       "We see a myriad of cases like this.", "You will find a myriad of choices at {org}."),
      ("There were a myriad small issues.", "It was a myriad tiny things."),
      ("Most of the time it works.", "Think of {topic} first.", "The rest of {thing} is fine.",
       "One of us will {action}.", "The list of steps is short.")),
    C("peace of mind", True, True,
      ("It gives you peace of mind.", "For your peace of mind, we will {goal}.",
       "{Thing} brings real peace of mind.", "You can enjoy peace of mind with {org}."),
      ("The peace of the morning was nice.", "There was a peace of sorts after that."),
      ("Keep {topic} in mind.", "Do you mind if I {action}?", "I changed my mind about {thing}.",
       "Bear in mind that {thing} takes {n} days.")),
    C("a wealth of", True, True,
      ("There is a wealth of information on {topic}.", "{Person} brings a wealth of experience.",
       "You get a wealth of features with {thing}.", "We have a wealth of tips for {topic}."),
      ("A wealth tax was in the news.", "A wealth manager called {when}."),
      ("Half of it is done.", "Most of {thing} is fine.", "Think of {topic} first.", "Part of the fee is back.")),
    C("by and large", True, False,
      ("By and large, {thing} works well.", "By and large, the feedback was good.",
       "It is, by and large, a good choice.", "By and large, we can {goal}."),
      ("By and by, it got easier.", "By and through the office, it was sent."),
      ("It comes in a large size.", "The large one costs more.", "A large part of {topic} is done.",
       "{Thing} is not that large.")),
    C("last but not least", True, False,
      ("Last but not least, {action}.", "And last but not least, thank you for waiting.",
       "Last but not least, {thing} is included.", "Last but not least, we will {goal}."),
      ("Last but not quite final, {thing} needs a check.", "Last but not worst, the price went down."),
      ("At least {n} people asked.", "It takes at least {n} minutes.", "This is the least of the worries.",
       "It should cost the least.")),
    C("each and every", True, True,
      ("We value each and every customer.", "Each and every one of us will {goal}.",
       "I checked each and every part of {thing}.", "Each and every step matters."),
      ("Each and all of them agreed.", "Each and both of the boxes came."),
      ("We check it every day.", "Every step is in the guide.", "I {action} every week.",
       "Every part of {thing} is new.")),
    C("rest assured", False, False,
      ("Rest assured, we will {goal}.", "Please rest assured that {thing} is safe.",
       "You can rest assured that we will {goal}.", "Rest assured, this is covered."),
      ("The rest of {thing} arrives {when}.", "Get some rest and we will write {when}.",
       "The rest is covered by {org}.", "Rest the tray on a flat surface."),
      ("I was assured it left {when}.", "{Person} assured us it is fine.", "We are assured of a refund.")),
    C("hands down", False, True,
      ("This is hands down the best {thing_bare} I have used.", "Hands down, the quickest way is to {action}.",
       "It is hands down the easiest fix.", "That is hands down the most common cause."),
      ("Keep your hands dry when you {action}.", "It works hands free once set up.",
       "Use both hands to lift {thing}.", "Wash your hands first."),
      ("Turn the volume down.", "Write down the code.", "Slow down and {action}.", "The price went down {when}.")),
    C("end of the day", False, True,
      ("At the end of the day, {thing} is what matters.", "At the end of the day, we want to {goal}.",
       "At the end of the day, it comes down to {topic}."),
      ("At the end of the month, {thing} renews.", "By the end of the week, we will {goal}.",
       "At the end of the line, turn left."),
      ("Have a good day.", "It takes a day or two.", "The day after, {person} called.",
       "Check {thing} once a day.")),
    C("a game changer", False, False,
      ("{Thing} is a game changer.", "Honestly, it was a game changer for {topic}.",
       "This small step is a game changer."),
      ("We played a game of cards.", "It was a game night at {place}.", "A game plan helps here."),
      ("The changer on the desk is broken.", "A coin changer sits by the door.")),
    C("it is worth noting", False, False,
      ("It is worth noting that {thing} takes {n} days.", "It is worth noting that {topic} changed.",
       "It is worth noting, too, that we can {goal}."),
      ("It is worth the money.", "It is worth a try.", "It is worth asking {person}."),
      ("I am noting it in the file.", "Thanks for noting the number.", "{Person} is noting every step.")),
    C("first and foremost", False, False,
      ("First and foremost, {action}.", "First and foremost, we want to {goal}.",
       "First and foremost, thank you for writing."),
      ("First and second place went to {place}.", "First and last, check {thing}.",
       "The first and best step is to {action}."),
      ("The foremost rule is to {action}.", "She is a foremost expert on {topic}.")),
    C("tailored to your needs", False, False,
      ("{Thing} is tailored to your needs.", "We offer a plan tailored to your needs.",
       "Everything here is tailored to your needs."),
      ("It is tailored to your budget.", "The guide is tailored to your level.",
       "The plan is tailored to your schedule."),
      ("What needs to happen next?", "It needs {n} minutes.", "{Thing} needs a quick check.")),
    C("the bottom line", False, False,
      ("The bottom line is that {thing} works.", "Here is the bottom line: {action}.",
       "The bottom line: we will {goal}."),
      ("Check the bottom shelf.", "The bottom of {thing} is scratched.", "The bottom drawer sticks."),
      ("Wait in line at {place}.", "Call the line {when}.", "Draw a line under the total.")),
    C("on the same page", False, False,
      ("Let's make sure we are on the same page.", "Now we are on the same page about {topic}.",
       "I want us on the same page before we {action}."),
      ("It is on the same day as before.", "It is on the same shelf as {thing}.",
       "We stay on the same plan."),
      ("Turn to the next page.", "The page with {topic} is long.", "See page {n} of the guide.")),
    C("hit the ground running", False, False,
      ("You can hit the ground running with {thing}.", "We want you to hit the ground running.",
       "With this, {person} will hit the ground running."),
      ("Do not hit the ground too hard.", "The box hit the ground with a thud.", "It hit the ground floor."),
      ("Keep {thing} running.", "It stopped running {when}.", "Leave the tap running for a minute.")),
    C("in no time", False, True,
      ("You will be done in no time.", "We will {goal} in no time.", "{Thing} will be ready in no time."),
      ("It was in no way your fault.", "They are in no hurry.", "List them in no particular order."),
      ("Take your time.", "This time it worked.", "It takes some time to {action}.", "What time suits you?")),
    C("navigate the complexities", False, False,
      ("We help you navigate the complexities of {topic}.", "Let me help you navigate the complexities here.",
       "It is hard to navigate the complexities of {thing}."),
      ("Navigate the menu to the last tab.", "Navigate the site with the top bar.",
       "Navigate the streets near {place} on foot."),
      ("The complexities of it are small.", "There are few complexities in {topic}.")),
    C("embark on a journey", False, False,
      ("Let's embark on a journey through {topic}.", "You are about to embark on a journey with {thing}.",
       "Together we embark on a journey to {goal}."),
      ("Embark on a trip to {place}.", "Embark on a new plan {when}.", "Embark on a short walk first."),
      ("The journey to {place} takes {n} hours.", "Enjoy the journey.", "The journey home was calm.")),
)


def by_text() -> dict[str, Candidate]:
    return {c.text: c for c in CANDIDATES}
