// Renders Ollama Modelfile TEMPLATEs with Go's own text/template, as Ollama does, for the
// Modelfile conformance tests (test_modelfile_go.py). Reads JSON from stdin:
//
//	[{"template": "...", "messages": [{"role": "user", "content": "..."}, ...]}, ...]
//
// and writes a JSON list of the rendered prompts (or {"error": "..."} per case) to stdout.
//
// The data given to the template is Ollama's (template.Execute in ollama/ollama's template
// package): .System is every system message joined by a blank line, .Messages the conversation
// with consecutive messages of one role merged by a blank line, each with .Role, .Content,
// .Thinking, .ToolCalls and .ToolName; .Prompt and .Response are empty, .Tools nil, .Think and
// .IsThinkSet false. The template is parsed with missingkey=zero and Ollama's one extra
// function, json.
package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"text/template"
)

type Message struct {
	Role      string `json:"role"`
	Content   string `json:"content"`
	Thinking  string `json:"thinking,omitempty"`
	ToolCalls []any  `json:"tool_calls,omitempty"`
	ToolName  string `json:"tool_name,omitempty"`
}

type Case struct {
	Template string    `json:"template"`
	Messages []Message `json:"messages"`
}

var funcs = template.FuncMap{
	"json": func(v any) string {
		b, _ := json.Marshal(v)
		return string(b)
	},
}

// collate is Ollama's: system messages joined, consecutive messages of one role merged.
func collate(msgs []Message) (string, []*Message) {
	var system []string
	var collated []*Message
	for i := range msgs {
		if msgs[i].Role == "system" {
			system = append(system, msgs[i].Content)
		}
		if len(collated) > 0 && collated[len(collated)-1].Role == msgs[i].Role && msgs[i].Role != "tool" {
			collated[len(collated)-1].Content += "\n\n" + msgs[i].Content
		} else {
			collated = append(collated, &msgs[i])
		}
	}
	return strings.Join(system, "\n\n"), collated
}

func render(c Case) (string, error) {
	tmpl, err := template.New("").Option("missingkey=zero").Funcs(funcs).Parse(c.Template)
	if err != nil {
		return "", err
	}
	system, messages := collate(c.Messages)
	var b bytes.Buffer
	err = tmpl.Execute(&b, map[string]any{
		"System":     system,
		"Messages":   messages,
		"Tools":      nil,
		"Prompt":     "",
		"Response":   "",
		"Think":      false,
		"IsThinkSet": false,
	})
	return b.String(), err
}

func main() {
	var cases []Case
	if err := json.NewDecoder(os.Stdin).Decode(&cases); err != nil {
		fmt.Fprintln(os.Stderr, "bad input:", err)
		os.Exit(2)
	}
	out := make([]any, len(cases))
	for i, c := range cases {
		s, err := render(c)
		if err != nil {
			out[i] = map[string]string{"error": err.Error()}
		} else {
			out[i] = s
		}
	}
	if err := json.NewEncoder(os.Stdout).Encode(out); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
