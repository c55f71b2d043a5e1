// promql-check parses PromQL expressions with Prometheus' own parser and
// reports, for each, the parse error or the metric names its selectors read.
//
// Input on stdin: a JSON array of strings. Output on stdout: a JSON array of
// {"expr": ..., "error": ..., "metrics": [...]} in the same order.
package main

import (
	"encoding/json"
	"fmt"
	"os"
	"sort"

	"github.com/prometheus/prometheus/model/labels"
	"github.com/prometheus/prometheus/promql/parser"
)

type result struct {
	Expr    string   `json:"expr"`
	Error   string   `json:"error,omitempty"`
	Metrics []string `json:"metrics"`
}

func names(expr parser.Expr) []string {
	seen := map[string]bool{}
	parser.Inspect(expr, func(node parser.Node, _ []parser.Node) error {
		if vs, ok := node.(*parser.VectorSelector); ok {
			if vs.Name != "" {
				seen[vs.Name] = true
			}
			for _, m := range vs.LabelMatchers {
				if m.Name == labels.MetricName && m.Type == labels.MatchEqual {
					seen[m.Value] = true
				}
			}
		}
		return nil
	})
	out := make([]string, 0, len(seen))
	for name := range seen {
		out = append(out, name)
	}
	sort.Strings(out)
	return out
}

func main() {
	var exprs []string
	if err := json.NewDecoder(os.Stdin).Decode(&exprs); err != nil {
		fmt.Fprintln(os.Stderr, "promql-check: stdin is not a JSON array of strings:", err)
		os.Exit(2)
	}
	results := make([]result, 0, len(exprs))
	for _, text := range exprs {
		r := result{Expr: text, Metrics: []string{}}
		if expr, err := parser.ParseExpr(text); err != nil {
			r.Error = err.Error()
		} else {
			r.Metrics = names(expr)
		}
		results = append(results, r)
	}
	if err := json.NewEncoder(os.Stdout).Encode(results); err != nil {
		fmt.Fprintln(os.Stderr, "promql-check:", err)
		os.Exit(2)
	}
}
