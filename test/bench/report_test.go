package bench

import (
	"fmt"
	"os"
	"runtime"
	"strings"
	"sync"
	"time"
)

// row is one line of the table.
type row struct {
	scenario, measure, figure, baseline, ratio, target, verdict string
}

var table struct {
	sync.Mutex
	rows  []row
	notes []string
}

func addRow(r row) {
	table.Lock()
	defer table.Unlock()
	table.rows = append(table.rows, r)
}

func addNote(format string, args ...any) {
	table.Lock()
	defer table.Unlock()
	table.notes = append(table.notes, fmt.Sprintf(format, args...))
}

func verdict(met bool) string {
	if met {
		return "met"
	}
	return "missed"
}

// render is the table in Markdown, with the command (target, and the go
// test arguments beyond ./test/bench), the machine and the date above it
// and the notes below.
func render(target, testArgs string, took time.Duration) string {
	table.Lock()
	defer table.Unlock()
	var b strings.Builder
	fmt.Fprintf(&b, "Command: `%s` (`go test %s./test/bench`, CREDBROKER_BENCH=1), %s, on %s.\n",
		target, testArgs+strings.Repeat(" ", min(len(testArgs), 1)), took.Round(time.Second), time.Now().UTC().Format("2006-01-02 15:04 MST"))
	fmt.Fprintf(&b, "Machine: nproc %d, memory %s, %s/%s, %s. The machine is shared with other builds and test runs;\n",
		runtime.NumCPU(), memTotal(), runtime.GOOS, runtime.GOARCH, runtime.Version())
	b.WriteString("the load generator shares its cores with the broker, the agents and the API servers.\n")
	b.WriteString("Absolute figures move from run to run; the ratios to the same-run baselines are what count.\n\n")
	b.WriteString("| scenario | measure | credbroker | baseline (same run) | ratio | target | |\n|---|---|---|---|---|---|---|\n")
	for _, r := range table.rows {
		fmt.Fprintf(&b, "| %s | %s | %s | %s | %s | %s | %s |\n", r.scenario, r.measure, r.figure, r.baseline, r.ratio, r.target, r.verdict)
	}
	if len(table.notes) > 0 {
		b.WriteString("\n")
		for _, n := range table.notes {
			fmt.Fprintf(&b, "- %s\n", n)
		}
	}
	return b.String()
}

func memTotal() string {
	data, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		return "unknown"
	}
	var kb int
	for _, line := range strings.Split(string(data), "\n") {
		if _, err := fmt.Sscanf(line, "MemTotal: %d kB", &kb); err == nil {
			return fmt.Sprintf("%.1f GiB", float64(kb)/(1<<20))
		}
	}
	return "unknown"
}

const (
	beginMarker, endMarker           = "<!-- bench:begin -->", "<!-- bench:end -->"
	fleetBeginMarker, fleetEndMarker = "<!-- bench-fleet:begin -->", "<!-- bench-fleet:end -->"
)

// writeDoc replaces what lies between the markers of `make bench` in path
// with text, or appends the markers and text when path has none.
func writeDoc(path, text string) error { return writeDocBetween(path, text, beginMarker, endMarker) }

// writeDocBetween replaces what lies between beginMarker and endMarker in
// path with text, or appends the markers and text when path has none.
func writeDocBetween(path, text, beginMarker, endMarker string) error {
	old, err := os.ReadFile(path)
	if err != nil && !os.IsNotExist(err) {
		return err
	}
	s := string(old)
	block := beginMarker + "\n" + text + endMarker
	i, j := strings.Index(s, beginMarker), strings.Index(s, endMarker)
	if i >= 0 && j > i {
		s = s[:i] + block + s[j+len(endMarker):]
	} else {
		s += "\n" + block + "\n"
	}
	return os.WriteFile(path, []byte(s), 0o644)
}
